"""The host's launch floor under a layer's time, and the CUDA graphs that remove it (cost.launch)."""

import dataclasses

import numpy as np
import pytest

from megatron_pipette.cost import launch
from megatron_pipette.cost.compute import stage_work
from megatron_pipette.cost.execution import Execution
from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import Infeasible, PipetteError
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import LayerProfile, ProfileEntry
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset

H200 = preset_cluster("dgx-h100", num_nodes=1, gpu="H200")
SMALL = dict(precision="bf16", global_batch_size=8, vocab_size=32000, seq_length=2048, max_position_embeddings=2048)
"""The H200 cost check's 1.28B GPT (docs/validation.md), Megatron's local layers."""


def small_job(tp: int = 4, **fields):
    w = workload_from_preset("gpt3-1.3b", attention_backend="local", **{**SMALL, **fields})
    return resolve_job(w, Layout(tensor_model_parallel_size=tp, micro_batch_size=1, data_parallel_size=1))


def per_layer(job, part: str) -> tuple[float, float]:
    """(priced seconds, device seconds) of one layer's `part` (forward or backward) on stage 0."""
    chunk = getattr(stage_work(job, H200), part)
    rate = float(H200.step_gemm_flops[0])
    device = chunk.flops / rate + chunk.mem_s
    return float(chunk.seconds(rate)[0, 0]), float(device[0, 0])


def test_the_measured_layer_counts_the_kernels_its_seconds_are_divided_by():
    kernels = launch.layer_kernels(small_job(tp=1), moe=False)
    assert sum(kernels.values(), launch.Kernels()) == launch.LOCAL_GPT_KERNELS == (16, 28, 0)


def test_a_small_local_layer_takes_the_hosts_time_to_launch_its_kernels():
    """The H200's 1.3B GPT layer at TP 4 took 2.74 ms forward against 0.20 ms priced
    (h200-2026-11-26-profiles): the host, not the GPU, sets its pace."""
    job = small_job()
    forward, device = per_layer(job, "forward")
    layers = job.chunk_sizes[0][0]
    assert device < 0.5e-3 * layers
    assert forward == pytest.approx(layers * 2.109e-3)


def test_a_large_layer_is_priced_at_its_device_time():
    job = resolve_job(workload_from_preset("llama3-8b", precision="bf16"),
                      Layout(micro_batch_size=1, data_parallel_size=1))
    for part in ("forward", "backward"):
        priced, device = per_layer(job, part)
        assert priced == device


def test_cuda_graphs_remove_the_floor_of_what_they_capture():
    plain = per_layer(small_job(), "forward")[0]
    attention = per_layer(small_job(cuda_graph_impl="local", cuda_graph_modules=("attn",)), "forward")[0]
    whole = per_layer(small_job(cuda_graph_impl="local"), "forward")
    step = per_layer(small_job(cuda_graph_impl="full_iteration"), "forward")
    assert plain > attention > whole[0] > 0
    assert whole[0] == pytest.approx(max(whole[1], 24 * launch.LOCAL_SECONDS_PER_KERNEL[0]))   # one replay a layer
    assert step[0] == step[1]


def test_a_measured_profile_is_not_floored_again():
    """A profile times the layer as it runs (in chains on a GPU), launches included."""
    job = small_job()
    entry = ProfileEntry(tensor_model_parallel_size=4, micro_batch_size=1, forward_s=1e-4, backward_s=2e-4,
                         activation_bytes=1)
    profile = LayerProfile(device_name="x", rank=0, layers=(entry,), embedding=(), output_layer=(), model={},
                           gemm_flops=float(H200.gemm_flops[0]))
    work = stage_work(job, H200, profile)
    assert work.profiled and np.all(work.forward.host_s == 0)


@pytest.mark.parametrize("fields, impl, modules", [
    (dict(cuda_graph_modules=("full",)), "none", ()),
    (dict(cuda_graph_impl="local", cuda_graph_modules=("full",)), "local", ()),
    (dict(cuda_graph_impl="none", cuda_graph_modules=("full_iteration",)), "full_iteration", ()),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=("mlp", "attn")), "transformer_engine",
     ("mlp", "attn")),
])
def test_cuda_graph_flags_are_read_as_megatron_reads_them(fields, impl, modules):
    w = workload_from_preset("gpt3-1.3b", **fields)
    assert (w.cuda_graph_impl, w.cuda_graph_modules) == (impl, modules)


def test_the_local_implementation_captures_the_router_and_its_preprocessing_together():
    moe = dict(num_experts=8, moe_router_topk=2, add_bias_linear=False, swiglu=True,
               moe_token_dispatcher_type="alltoall")
    w = workload_from_preset("gpt3-1.3b", cuda_graph_impl="local", cuda_graph_modules=("moe_router",), **moe)
    assert set(w.cuda_graph_modules) == {"moe_router", "moe_preprocess"}
    with pytest.raises(PipetteError, match="moe_preprocess needs moe_router"):
        workload_from_preset("gpt3-1.3b", cuda_graph_impl="transformer_engine",
                             cuda_graph_modules=("moe_preprocess",), **moe)


@pytest.mark.parametrize("fields, message", [
    (dict(cuda_graph_impl="full_iteration", cuda_graph_modules=("attn",)), "must be empty"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=("moe_router",)), "need --num-experts"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=("mamba",)), "mamba needs Mamba layers"),
    (dict(cuda_graph_impl="eager"), "--cuda-graph-impl must be one of"),
])
def test_cuda_graph_settings_megatron_refuses_are_refused(fields, message):
    with pytest.raises(PipetteError, match=message):
        workload_from_preset("gpt3-1.3b", **fields)


def test_per_layer_graphs_exclude_full_recomputation():
    w = workload_from_preset("gpt3-1.3b", cuda_graph_impl="transformer_engine")
    layout = Layout(micro_batch_size=1, data_parallel_size=1, recompute_granularity="full",
                    recompute_method="uniform", recompute_num_layers=1)
    with pytest.raises(Infeasible, match="full_iteration graph only"):
        resolve_job(w, layout)
    resolve_job(dataclasses.replace(w, cuda_graph_impl="full_iteration"), layout)


@pytest.mark.parametrize("graphs, charged", [(dict(), True),
                                             (dict(cuda_graph_impl="local", cuda_graph_modules=("attn",)), True),
                                             (dict(cuda_graph_impl="full_iteration"), False)])
def test_an_moe_layer_pays_its_fixed_cost_unless_a_graph_captures_it(graphs, charged):
    """Execution.moe_layer_fixed_s is the host's wait and launches of an MoE layer: a graph that
    captures the whole layer (Megatron's sync-free dispatch) leaves neither."""
    moe = dict(num_experts=8, moe_router_topk=2, add_bias_linear=False, swiglu=True,
               moe_token_dispatcher_type="alltoall")
    job = resolve_job(workload_from_preset("gpt3-1.3b", **{**SMALL, **moe, **graphs}),
                      Layout(micro_batch_size=1, data_parallel_size=8, expert_model_parallel_size=8))
    ep = [CostModel(H200, execution=Execution(moe_layer_fixed_s=fixed)).time(job).breakdown.ep_comm_s
          for fixed in (0.0, 1e-3)]
    assert launch.moe_layer_graphed(job.workload) is not charged
    assert (ep[1] > ep[0]) is charged
