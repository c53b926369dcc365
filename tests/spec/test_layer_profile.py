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
    SCHEMA,
    VERSION,
    LayerProfile,
    ProfiledModel,
    ProfileEntry,
    ProfileFile,
    check_profile_matches,
    profile_extrapolations,
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
                        model=ProfiledModel.of(GPT))


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


WRITTEN_MODEL = {"hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256, "num_query_groups": 4,
                 "seq_length": 64, "swiglu": False, "precision": "fp32", "vocab_size": 1024,
                 "normalization": "LayerNorm", "add_bias_linear": True, "position_embedding_type": "learned_absolute",
                 "attention_backend": "local", "hidden_dropout": 0.1, "attention_dropout": 0.1}
"""A CPU rehearsal's layer_profile.json model block, as the profiler wrote it before the record was typed."""


def profile_doc(**top) -> dict:
    return {"schema": SCHEMA, "version": VERSION, "device": {"device_name": "cpu"},
            "layers": [{"tensor_model_parallel_size": 1, "micro_batch_size": 1, "forward_s": 1.0, "backward_s": 1.0,
                        "activation_bytes": 1}], **top}


def test_a_profile_written_before_the_model_was_typed_reads_as_its_model():
    read = ProfileFile.from_json(profile_doc(model=WRITTEN_MODEL))
    tiny = workload_from_preset("tiny-gpt", precision="fp32", attention_backend="local")
    assert read.profile.model == ProfiledModel.of(tiny) and read.profile.model.to_json() == WRITTEN_MODEL
    check_profile_matches(read.profile, tiny)
    assert read.workload().hidden_size == 64 and read.workload().attention_backend == "local"


def test_a_profile_naming_no_model_reads_and_serves_none():
    read = ProfileFile.from_json(profile_doc())
    assert read.profile.model == ProfiledModel()
    with pytest.raises(PipetteError, match="profiled for another model: hidden_size=None"):
        check_profile_matches(read.profile, GPT)


@pytest.mark.parametrize("field, value, kind", [("hidden_size", "64", "an integer"), ("swiglu", 1, "true or false"),
                                                ("precision", "fp8", "one of fp32, fp16, bf16"),
                                                ("hidden_dropout", "0.1", "a number")])
def test_a_malformed_model_is_refused_naming_the_file_and_field(field, value, kind):
    with pytest.raises(PipetteError, match=f"^p.json: model.{field} must be {kind}, got {value!r}$"):
        ProfileFile.from_json(profile_doc(model={**WRITTEN_MODEL, field: value}), "p.json")


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
