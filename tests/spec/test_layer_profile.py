"""A layer profile used beyond what it measured: refused for another model, named where extrapolated."""

import dataclasses

import pytest

from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import PipetteError
from megatron_pipette.plan.planner import plan
from megatron_pipette.report.plan_document import PlanRecord, plan_json
from megatron_pipette.report.plans import estimate_report, plan_report
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import (
    LayerProfile,
    ProfileEntry,
    check_profile_matches,
    profile_extrapolations,
    profile_model_fields,
)
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset

GPT = workload_from_preset("gpt3-1.3b", global_batch_size=64)
A100 = preset_cluster("dgx-a100", num_nodes=1)


def entry(mbs: int, rc: str | None = None, measured: bool = True) -> ProfileEntry:
    return ProfileEntry(tensor_model_parallel_size=1, micro_batch_size=mbs, forward_s=0.01 * mbs,
                        backward_s=0.02 * mbs, activation_bytes=1 << 20, recompute_granularity=rc, measured=measured)


def profile(*layers: ProfileEntry) -> LayerProfile:
    ends = (entry(1), entry(2), entry(4))
    return LayerProfile(device_name="x", rank=0, layers=layers or ends, embedding=ends, output_layer=ends,
                        model=profile_model_fields(GPT))


def job(mbs: int, **layout) -> object:
    return resolve_job(GPT, Layout(data_parallel_size=8, micro_batch_size=mbs, **layout))


@pytest.mark.parametrize("field, value", [("vocab_size", 32000), ("seq_length", 4096)])
def test_a_profile_of_another_vocabulary_or_sequence_length_is_refused_in_one_line(field, value):
    """Its output layer (vocabulary) or its attention's share of the layer (sequence) is another model's:
    no linear scaling recovers them."""
    other = dataclasses.replace(GPT, **{field: value}, **({"max_position_embeddings": value}
                                                         if field == "seq_length" else {}))
    check_profile_matches(profile(), GPT)
    with pytest.raises(PipetteError, match=f"profiled for another model: {field}=") as error:
        check_profile_matches(profile(), other, where="--layer-profile p.json")
    assert "\n" not in str(error.value) and str(error.value).startswith("--layer-profile p.json")


def test_measured_shapes_name_nothing():
    assert profile_extrapolations(profile(), job(2)) == ()


def test_a_micro_batch_size_never_profiled_is_named_with_what_was():
    lines = profile_extrapolations(profile(), job(8))
    assert lines == ("layer, embedding and output layer at tp 1: profiled at micro-batch 1,2,4; micro-batch 8 "
                     "extrapolated linearly from 4",)


def test_entries_the_profiler_did_not_measure_are_named():
    lines = profile_extrapolations(profile(entry(1), entry(2, measured=False), entry(4)), job(2))
    assert lines == ("layer at tp 1: micro-batch 2 interpolated or derived by the profiler, not measured",)


def test_recomputation_priced_from_the_rooflines_share_is_named():
    lines = profile_extrapolations(profile(entry(1), entry(2), entry(4)),
                                   job(2, recompute_granularity="full", recompute_method="uniform",
                                       recompute_num_layers=1))
    assert len(lines) == 1 and "full recomputation's redone forward taken as the roofline's share" in lines[0]


def test_plans_and_estimates_carry_the_extrapolations():
    """The estimate's report, the plan's report and its document (read back) name them; an older
    plan document without the field still reads."""
    model = CostModel(A100, profile=profile())
    time = model.time(job(8))
    assert time.extrapolations == profile_extrapolations(profile(), job(8))
    report = estimate_report("tp1 dp8 mbs8", time, model.memory(job(8)))
    assert "Layer profile extrapolated: layer, embedding and output layer at tp 1" in report
    result = plan(GPT, model, constraints={"tensor_model_parallel_size": 1, "micro_batch_size": 8,
                                           "pipeline_model_parallel_size": 1}, top_k=1, placement_top=1)
    assert "micro-batch 8 extrapolated linearly from 4" in plan_report(result)
    doc = plan_json(result)
    record = PlanRecord.from_json(doc, "plan.json")
    assert record.best.extrapolations == time.extrapolations
    del doc["candidates"][0]["extrapolations"]
    assert PlanRecord.from_json(doc, "plan.json").best.extrapolations == ()
    doc["candidates"][0]["extrapolations"] = "mbs 8"
    with pytest.raises(PipetteError, match="extrapolations must list strings"):
        PlanRecord.from_json(doc, "plan.json")
