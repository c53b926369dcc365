"""A plan is checked against the job before any rank applies it (integration.plan_check, torch-free)."""

import dataclasses
import json
from dataclasses import replace

import pytest

from helpers.plans import plan_doc
from megatron_pipette.calibration.check import CheckResult, StageCheck
from megatron_pipette.calibration.document import CalibrationRef
from megatron_pipette.calibration.fit import Factors
from megatron_pipette.errors import PipetteError
from megatron_pipette.integration.plan_check import JobRequest, plan_problems
from megatron_pipette.report.plan_document import PlanRecord
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.resume import resume_rule
from megatron_pipette.spec.workload import workload_from_preset

TINY = workload_from_preset("tiny-gpt")
DP4 = Layout(data_parallel_size=4, micro_batch_size=2)
MOE = dataclasses.replace(TINY, num_experts=4, swiglu=True, add_bias_linear=False)


def request(**kw) -> JobRequest:
    return JobRequest(**{"workload": TINY, "world_size": 4, "gpus_per_node": 4, **kw})


def record(doc: dict) -> PlanRecord:
    return PlanRecord.from_json(doc, "p.json")


def test_a_plan_for_this_job_passes() -> None:
    assert plan_problems(record(plan_doc(TINY, DP4)), request()) == []
    pinned = plan_doc(dataclasses.replace(TINY, name="from pipette plan"), DP4)
    assert plan_problems(record(pinned), request()) == []     # the model's name is a label


@pytest.mark.parametrize("doc, req, problem", [
    (plan_doc(workload_from_preset("tiny-gpt", global_batch_size=48), Layout(data_parallel_size=4,
                                                                              micro_batch_size=3)),
     request(), "--global-batch-size 48 in the plan, 16 here"),
    (plan_doc(workload_from_preset("tiny-gpt", precision="fp16"), DP4), request(),
     f"precision fp16 in the plan, {TINY.precision} here"),
    (plan_doc(TINY, Layout(data_parallel_size=8), node_order=(0, 1)), request(),
     "the plan is for 2 node(s) of 4 processes, this job has 1 of 4"),
    (plan_doc(TINY, Layout(data_parallel_size=8), node_order=(0, 1)), request(world_size=8, gpus_per_node=2),
     "the plan is for 2 node(s) of 4 processes, this job has 4 of 2"),
    (plan_doc(TINY, Layout(data_parallel_size=8), node_order=(1, 1)), request(world_size=8),
     "the plan's node order [1, 1] is not an order of its 2 nodes"),
    (plan_doc(TINY, DP4), request(typed={"tensor_model_parallel_size": 2}),
     "--tensor-model-parallel-size is 1 in the plan, 2 fixed here"),
    (plan_doc(TINY, DP4), request(checkpoint=resume_rule(replace(DP4, use_distributed_optimizer=True), moe=False,
                                                         loads_optimizer=True, optimizer_sharding="fully_reshardable")),
     "--use-distributed-optimizer is False in the plan, True fixed here by the checkpoint"),
    (plan_doc(MOE, DP4), request(workload=MOE, checkpoint=resume_rule(
        replace(DP4, expert_model_parallel_size=2), moe=True, loads_optimizer=True, optimizer_sharding=None)),
     "it cannot load the checkpoint: its expert parameters have an optimizer of their own, which megatron-core "
     "gives them only under EP > 1 or ETP != TP; tp1 pp1 dp4 mbs2 has EP 1 and ETP = TP"),
    (plan_doc(TINY, Layout(data_parallel_size=4, micro_batch_size=3)), request(),
     "Megatron would reject its layout: --global-batch-size 16 is not divisible by --micro-batch-size 3 x "
     "data-parallel size 4"),
    (plan_doc(TINY, Layout(tensor_model_parallel_size=8, data_parallel_size=1), gpus_per_node=8),
     request(world_size=8, gpus_per_node=8),
     "Megatron would reject its layout: --num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"),
    (plan_doc(TINY, DP4), request(eval_global_batch_size=12),
     "--eval-global-batch-size 12 is not divisible by --eval-micro-batch-size 2 x data-parallel size 4"),
    (plan_doc(TINY, DP4), request(eval_micro_batch_size=8),
     "--eval-global-batch-size 16 is not divisible by --eval-micro-batch-size 8 x data-parallel size 4"),
], ids=["global batch", "precision", "world size", "processes per node", "node order", "typed flag",
        "checkpoint", "expert optimizer", "batch rule", "heads rule", "eval batch", "eval micro-batch"])
def test_a_plan_that_cannot_run_this_job_says_why(doc, req, problem: str) -> None:
    problems = plan_problems(record(doc), req)
    assert any(p.startswith(problem) or problem in p for p in problems), problems


@pytest.mark.parametrize("doc, problem", [
    ({**plan_doc(TINY, DP4), "version": 0}, "p.json: not a megatron-pipette plan"),
    ({**plan_doc(TINY, DP4), "model": None}, "p.json: the plan has no model"),
    ({**plan_doc(TINY, DP4), "candidates": [{"layout": {"tensor_model_parallel_size": "x"}}]},
     "p.json: malformed candidate"),
    ({**plan_doc(TINY, DP4), "world_size": None}, "p.json: malformed plan"),
    ({**plan_doc(TINY, DP4), "model": {**dataclasses.asdict(TINY), "num_layers": 0}},
     r"^p.json: malformed model \(.*--num-layers"),
    ({**plan_doc(TINY, DP4), "model": {**dataclasses.asdict(TINY), "layers": 2}},
     "^p.json: malformed model .*'layers'"),
], ids=["old version", "no model", "malformed", "malformed header", "model value", "model field"])
def test_a_document_that_is_not_a_plan_is_refused_by_its_reader(doc, problem: str) -> None:
    with pytest.raises(PipetteError, match=problem):
        record(doc)


def test_the_record_reads_the_model_as_a_workload() -> None:
    assert record(plan_doc(MOE, DP4)).model == MOE


CHECK = CheckResult(iterations=(2, 6), predicted_s=0.069, measured_s=0.11, forward_backward_s=0.084, stages=(
    StageCheck(stage=0, ranks=2, compute_s=0.05, predicted_peak_bytes=100, measured_peak_bytes=120,
               predicted_terms={"model state": 50, "activations": 30, "overheads": 20},
               measured_terms={"model state": 50, "activations": 50, "overheads": 20},
               predicted_tensors={"model state": 50, "activations": 30}, measured_tensors=None),),
    missing_ranks=(3,))


def as_written(value: dict) -> dict:
    return json.loads(json.dumps(value))


CHECKED = as_written(replace(record(plan_doc(TINY, DP4)), self_check=CHECK).to_json())
"""A plan document as the self-check writes it back."""


WRITTEN_CHECK = {
    "iterations": [2, 6], "predicted_s": 0.06900179066404145, "measured_s": 0.11080296400086809,
    "forward_backward_s": 0.08368460949986911, "stages": [{
        "stage": 0, "ranks": 4, "compute_s": 0.05324791449947952, "predicted_peak_bytes": 2163341771,
        "predicted_terms": {"model state": 5363712, "activations": 9863168, "overheads": 2148114891},
        "measured_peak_bytes": None, "measured_terms": None,
        "predicted_tensors": {"model state": 5363712, "activations": 9076736},
        "measured_tensors": {"model state": 5684848, "activations": 9151748}}],
    "missing_ranks": [], "margin": 0.05, "time_error": 0.6057983848614854, "over_memory": []}
"""A CPU rehearsal's self-check as a cached plan.json holds it (written before the record was typed)."""
WRITTEN_CALIBRATION = {"id": "3f2a9c41d0b7e655", "factors": {
    "compute_rate": 1.0434915753790066, "memory_rate": 0.05037420638752311,
    "link_bandwidth": {"intra_node": 0.3071553156141707}, "memory_overhead_bytes": 0}}
"""The calibration a plan was made with, as the hook wrote it before the record was typed."""


def test_the_record_writes_back_the_document_it_read() -> None:
    """Old cached plans keep their format: read and written again, a document is unchanged."""
    doc = {**plan_doc(TINY, DP4), "phases_s": {"plan": 0.5}, "calibration": WRITTEN_CALIBRATION,
           "self_check": WRITTEN_CHECK}
    assert record(doc).self_check.measured_s == WRITTEN_CHECK["measured_s"]
    assert record(doc).calibration == CalibrationRef("3f2a9c41d0b7e655", Factors(
        compute_rate=1.0434915753790066, memory_rate=0.05037420638752311,
        link_bandwidth={"intra_node": 0.3071553156141707}, memory_overhead_bytes=0))
    assert as_written(record(doc).to_json()) == doc
    assert record(CHECKED).self_check == CHECK


def test_a_self_check_written_before_tensors_were_counted_still_reads() -> None:
    old = as_written(CHECKED["self_check"])
    for stage in old["stages"]:
        del stage["predicted_tensors"], stage["measured_tensors"]
    check = record({**CHECKED, "self_check": old}).self_check
    assert check is not None and check.stages[0].predicted_tensors == {} and check.stages[0].measured_tensors is None
    assert check.lines() == CHECK.lines()


@pytest.mark.parametrize("calibration", [{"id": "c1", "factors": {"compute": 1.1}},
                                         {**WRITTEN_CALIBRATION, "factors": {**WRITTEN_CALIBRATION["factors"],
                                                                             "link_bandwidth": [1.0]}}])
def test_a_malformed_calibration_is_refused_naming_the_file_and_field(calibration: dict) -> None:
    with pytest.raises(PipetteError, match=r"^p.json: malformed calibration \("):
        record({**plan_doc(TINY, DP4), "calibration": calibration})


@pytest.mark.parametrize("check", [{"measured_s": 0.2}, {**CHECKED["self_check"], "iterations": [2]},
                                   {**CHECKED["self_check"], "stages": [{"stage": "first"}]}])
def test_a_malformed_self_check_is_refused_naming_the_file_and_field(check: dict) -> None:
    with pytest.raises(PipetteError, match=r"^p.json: malformed self_check \("):
        record({**plan_doc(TINY, DP4), "self_check": check})
