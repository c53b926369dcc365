"""Megatron-FSDP (--use-megatron-fsdp): its strategies' memory, its per-layer collectives' time, its refusals."""

import dataclasses

import numpy as np
import pytest

from megatron_pipette.cost import fsdp
from megatron_pipette.cost.memory import estimate_memory
from megatron_pipette.cost.model import CostModel
from megatron_pipette.cost.parameters import stage_parameters
from megatron_pipette.errors import Infeasible, PipetteError
from megatron_pipette.plan.planner import evaluate
from megatron_pipette.spec.hardware import lookup_gpu, preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout, validate_layout
from megatron_pipette.spec.megatron_flags import refusals
from megatron_pipette.spec.workload import workload_from_preset

LLAMA = dataclasses.replace(workload_from_preset("llama3-8b"), global_batch_size=64)
H100 = lookup_gpu("H100").memory_bytes
DOPT = dict(data_parallel_size=16, use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)


def stage(strategy: str | None):
    layout = Layout(**DOPT, use_megatron_fsdp=strategy is not None,
                    **({"data_parallel_sharding_strategy": strategy} if strategy else {}))
    return estimate_memory(resolve_job(LLAMA, layout), H100).stages[0]


def test_each_strategy_shards_what_it_names():
    """optim is the distributed optimizer; optim_grads shards the gradients too, optim_grads_params the weights."""
    dopt, optim, grads, params = (stage(s) for s in (None, "optim", "optim_grads", "optim_grads_params"))
    assert (optim.weight_bytes, optim.gradient_bytes, optim.optimizer_bytes) == \
        (dopt.weight_bytes, dopt.gradient_bytes, dopt.optimizer_bytes)
    assert grads.weight_bytes == dopt.weight_bytes and grads.gradient_bytes < dopt.gradient_bytes / 3
    assert params.weight_bytes < dopt.weight_bytes / 3 and params.gradient_bytes == grads.gradient_bytes
    assert params.optimizer_bytes == dopt.optimizer_bytes


def test_fully_sharded_weights_are_a_shard_two_layers_and_the_embeddings_by_hand():
    """Llama 3 8B, DP 16, bf16: a 1/16 shard of everything, two of its 32 layers whole, and the word
    embedding and output layer (outside the FSDP units, kept gathered) whole."""
    job = resolve_job(LLAMA, Layout(**DOPT, use_megatron_fsdp=True))
    p = stage_parameters(job)
    total, layers = int(p.dense[0]), int(p.dense_in_layers[0])
    outside = total - layers
    expected = 2 * (total / 16 + layers * 2 / 32 + outside)
    assert estimate_memory(job, H100).stages[0].weight_bytes == pytest.approx(expected, abs=1)


def test_of_the_gradients_outside_the_layers_only_the_output_layers_are_whole_at_the_peak():
    """The untied word embedding's gradient is made after the last layer's backward, once the
    activations are freed, and reduce-scattered and freed before the next forward: at the peak only
    the output layer's and final norm's gradients are whole beside the shard and two layers'."""
    job = resolve_job(LLAMA, Layout(**DOPT, use_megatron_fsdp=True))
    p = stage_parameters(job)
    total, layers = int(p.dense[0]), int(p.dense_in_layers[0])
    embedding = LLAMA.padded_vocab_size(1) * LLAMA.hidden_size
    expected = LLAMA.grad_bytes * (total / 16 + layers * 2 / 32 + total - layers - embedding)
    assert fsdp.embedding_gradient_parameters(job) == embedding
    assert estimate_memory(job, H100).stages[0].gradient_bytes == pytest.approx(expected, abs=1)


def test_fp8_gathered_weights_are_sharded_once_and_only_the_running_layer_has_its_transpose():
    """--fp8-param-gather on Hopper (FP8 weight and transpose, 2 bytes a layer parameter when whole):
    the sharded buffer holds the 1-byte FP8 weight, the two gathered layers theirs, and only the layer
    in its backward its transpose."""
    fp8 = dataclasses.replace(LLAMA, fp8="hybrid", fp8_recipe="tensorwise", fp8_param_gather=True)
    job = resolve_job(fp8, Layout(**DOPT, use_megatron_fsdp=True))
    p = stage_parameters(job)
    total, layers = int(p.dense[0]), int(p.dense_in_layers[0])
    outside = total - layers
    expected = layers / 16 + 2 * outside / 16 + (2 + 1) * layers / 32 + 2 * outside
    assert estimate_memory(job, H100).stages[0].weight_bytes == pytest.approx(expected, abs=1)


def _gather_case(cluster):
    job = resolve_job(LLAMA, Layout(**DOPT, use_megatron_fsdp=True))
    links = CostModel(cluster).links(job)
    layers = np.array([[32]])
    return job, links, stage_parameters(job), layers


def test_without_compute_to_hide_behind_every_layer_gather_and_reduce_scatter_shows():
    job, links, params, layers = _gather_case(preset_cluster("dgx-h100", num_nodes=2))
    zero = np.zeros((16, 1, 1))
    f, b = fsdp.microbatch_exposed(job, links, layers, zero, zero, share=0.0)
    layer = params.dense_in_layers[0] / 32
    gather = links.dp_cp_groups.all_gather_s(np.array([[2 * layer]])).max()
    reduce = links.dp_cp_groups.reduce_scatter_s(np.array([[LLAMA.grad_bytes * layer]])).max()
    assert f == pytest.approx(np.full((16, 1, 1), 32 * gather))
    assert b == pytest.approx(np.full((16, 1, 1), 32 * (gather + reduce)))


def test_behind_long_layers_only_the_first_gather_shows_and_the_rest_takes_its_share():
    job, links, params, layers = _gather_case(preset_cluster("dgx-h100", num_nodes=2))
    long = np.full((16, 1, 1), 1e3)
    f, _ = fsdp.microbatch_exposed(job, links, layers, long, long, share=0.1)
    gather = links.dp_cp_groups.all_gather_s(np.array([[2 * params.dense_in_layers[0] / 32]])).max()
    assert f == pytest.approx(np.full((16, 1, 1), gather + 0.1 * 31 * gather))


def test_the_gathers_are_priced_in_the_iteration():
    """Over two nodes' InfiniBand every micro-batch's layer gathers cost more than the distributed
    optimizer's one gather and reduction per iteration; optim costs what the distributed optimizer does."""
    cluster = preset_cluster("dgx-h100", num_nodes=2)
    model = CostModel(cluster)

    def time(**kw):
        return evaluate(model, resolve_job(LLAMA, Layout(**DOPT, micro_batch_size=1, **kw)))[0]

    dopt, optim = time(), time(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim")
    full = time(use_megatron_fsdp=True)
    assert optim.iteration_time_s == pytest.approx(dopt.iteration_time_s)
    assert full.breakdown.dp_comm_exposed_s > dopt.breakdown.dp_comm_exposed_s
    assert sum(full.breakdown.as_dict().values()) == pytest.approx(full.iteration_time_s)


@pytest.mark.parametrize("kw, words", [
    (dict(pipeline_model_parallel_size=2, data_parallel_size=8), "--pipeline-model-parallel-size 2"),
    (dict(use_distributed_optimizer=False, overlap_param_gather=False), "--use-distributed-optimizer"),
])
def test_what_is_not_priced_is_refused_by_name(kw, words):
    with pytest.raises(Infeasible, match=f"--use-megatron-fsdp.*{words}"):
        validate_layout(LLAMA, Layout(**{**DOPT, **kw}, use_megatron_fsdp=True), 16)


def test_an_mxfp8_parameter_gather_and_an_unknown_strategy_are_refused():
    mx = dataclasses.replace(LLAMA, fp8="e4m3", fp8_recipe="mxfp8", fp8_param_gather=True,
                             reuse_grad_buf_for_mxfp8_param_ag=True)
    with pytest.raises(Infeasible, match="--fp8-recipe mxfp8 and --fp8-param-gather"):
        validate_layout(mx, Layout(**DOPT, use_megatron_fsdp=True), 16)
    with pytest.raises(PipetteError, match="--data-parallel-sharding-strategy no_shard: "):
        validate_layout(LLAMA, Layout(**DOPT, use_megatron_fsdp=True, data_parallel_sharding_strategy="no_shard"), 16)


def test_megatron_fsdp_is_modelled_and_its_other_settings_and_torch_fsdp2_refused():
    assert refusals({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim"}) == []
    assert [r.flag for r in refusals({"use_torch_fsdp2": True, "fsdp_double_buffer": True})] == \
        ["--use-torch-fsdp2", "--fsdp-double-buffer"]


def test_the_layout_says_and_writes_it():
    layout = Layout(**DOPT, use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads")
    assert "fsdp/optim_grads" in layout.describe()
    assert {"--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads"} <= set(layout.megatron_args())
    assert not any("sharding" in a for a in Layout(**DOPT).megatron_args())
