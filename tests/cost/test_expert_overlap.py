"""--overlap-moe-expert-parallel-comm and --delay-wgrad-compute: megatron-core 0.19's rules, its
combined 1F1B schedule's extra warmup forward and the memory of its paired steps, and the time the
layer-by-layer pairing saves."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_pipette.cost import memory
from megatron_pipette.cost.model import CostModel
from megatron_pipette.cost.schedules import schedule_for
from megatron_pipette.cost.timing import _dispatch, _expert_overlap_saving
from megatron_pipette.errors import PipetteError
from megatron_pipette.plan.search import enumerate_layouts
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Infeasible, Layout, validate_layout
from megatron_pipette.spec.workload import Workload

CLUSTER = preset_cluster("dgx-h100", num_nodes=4, precision="bf16")


def qwen_moe(**kw):
    """Qwen3-235B-A22B's layer shapes, cut to 16 layers."""
    base = dict(num_layers=16, hidden_size=4096, num_attention_heads=64, group_query_attention=True,
                num_query_groups=4, kv_channels=128, seq_length=4096, global_batch_size=256, precision="bf16",
                normalization="RMSNorm", position_embedding_type="rope", attention_dropout=0.0, hidden_dropout=0.0,
                add_bias_linear=False, swiglu=True, qk_layernorm=True, num_experts=128, moe_router_topk=8,
                moe_ffn_hidden_size=1536, ffn_hidden_size=12288, moe_token_dispatcher_type="alltoall",
                untie_embeddings_and_output_weights=True)
    return Workload(**{**base, **kw})


def layout(**kw):
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, data_parallel_size=16,
                expert_model_parallel_size=16, num_layers_per_virtual_pipeline_stage=2,
                use_distributed_optimizer=True, overlap_moe_expert_parallel_comm=True)
    return Layout(**{**base, **kw})


MEGATRON_CASES = [
    ({}, {}),
    ({"expert_model_parallel_size": 1, "data_parallel_size": 16}, {"expert_model_parallel_size": 1}),
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
     {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}),
    ({"recompute_granularity": "selective", "recompute_modules": ("moe",)},
     {"recompute_granularity": "selective", "recompute_modules": ["moe"]}),
    ({"recompute_granularity": "selective", "recompute_modules": ("moe_act", "layernorm")},
     {"recompute_granularity": "selective", "recompute_modules": ["moe_act", "layernorm"]}),
    ({"num_layers_per_virtual_pipeline_stage": None}, {"virtual_pipeline_model_parallel_size": None}),
    ({"overlap_moe_expert_parallel_comm": False, "delay_wgrad_compute": True},
     {"overlap_moe_expert_parallel_comm": False, "delay_wgrad_compute": True}),
    ({"delay_wgrad_compute": True}, {"delay_wgrad_compute": True}),
]


@pytest.mark.megatron
@pytest.mark.parametrize("pipette, megatron", MEGATRON_CASES)
def test_refuses_what_megatron_refuses(pipette, megatron):
    """The layout validates exactly where megatron-core's TransformerConfig accepts the same settings."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = dict(num_layers=16, hidden_size=64, num_attention_heads=4, num_moe_experts=128, moe_router_topk=8,
                  bf16=True, pipeline_dtype=torch.bfloat16, pipeline_model_parallel_size=2,
                  virtual_pipeline_model_parallel_size=4, expert_model_parallel_size=16,
                  overlap_moe_expert_parallel_comm=True, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True)
    try:
        TransformerConfig(**{**config, **megatron})
        megatron_accepts = True
    except (AssertionError, ValueError):
        megatron_accepts = False
    try:
        validate_layout(qwen_moe(), layout(**pipette), 32)
        pipette_accepts = True
    except Infeasible:
        pipette_accepts = False
    assert pipette_accepts == megatron_accepts


def test_refusals_name_the_flag():
    with pytest.raises(Infeasible, match="--overlap-moe-expert-parallel-comm needs --moe-token-dispatcher-type"):
        validate_layout(qwen_moe(moe_token_dispatcher_type="allgather"), layout(), 32)
    with pytest.raises(Infeasible, match="--overlap-moe-expert-parallel-comm allows at most one --mtp-num-layers"):
        validate_layout(qwen_moe(mtp_num_layers=2), layout(), 32)
    with pytest.raises(Infeasible, match="--window-size is not modelled"):
        validate_layout(qwen_moe(window_size="127,0"), layout(), 32)


@pytest.mark.megatron
@pytest.mark.parametrize("pp, vpp, m", [(2, 4, 8), (4, 2, 8), (4, 3, 12), (8, 3, 16), (1, 1, 4), (4, 2, 4)])
def test_one_more_warmup_forward_as_megatron_schedules(pp, vpp, m):
    """get_pp_rank_microbatches with overlap_moe_expert_parallel_comm (megatron-core 0.19, called
    with a stand-in communicator): one more forward before the first backward on every rank (the
    time model's warmup); the chunks held are those warmup forwards, since every later forward runs
    beside a backward that frees a layer as it stores one: as many as without the overlap. Without
    a pipeline (combined_1f1b_schedule_for_no_pipelining: the first forward alone, then each
    forward beside the previous backward) one."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    for rank in range(pp):
        group = SimpleNamespace(size=lambda: pp, rank=lambda r=rank: r)
        comm = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        _, _, warmup, _ = get_pp_rank_microbatches(m, vpp, pp, overlap_moe_expert_parallel_comm=True,
                                                   p2p_communicator=comm)
        if pp > 1:
            assert schedule_for(pp, vpp).warmup_microbatches(pp, rank, m, vpp, extra=1) == warmup
        assert memory.microbatches_in_flight(pp, rank, m, vpp) == (1 if pp == 1 else warmup)


@pytest.mark.parametrize("kw", [{}, {"pipeline_model_parallel_size": 1, "data_parallel_size": 32,
                                     "num_layers_per_virtual_pipeline_stage": None}])
def test_the_paired_step_holds_one_layer_more_not_one_chunk(kw):
    """The combined 1F1B runs forward layer i beside backward layer L-1-i and releases the latter
    (TransformerModelChunkSchedulePlan.run): the activations in flight are the chunks without the
    overlap, and the paired step's transient one layer (all MoE here) more."""
    cost = CostModel(CLUSTER)
    on_job = resolve_job(qwen_moe(), layout(**kw), 32)
    on = cost.memory(on_job).stages
    off = cost.memory(resolve_job(qwen_moe(), layout(overlap_moe_expert_parallel_comm=False, **kw), 32)).stages
    layer = memory._formula_layer_bytes(on_job, None, moe=True)
    assert [s.activation_bytes for s in on] == [s.activation_bytes for s in off]
    assert on[0].transient_bytes == off[0].transient_bytes + layer
    assert on[0].total_bytes > off[0].total_bytes


def test_no_paired_step_where_every_forward_is_warmup():
    """Two micro-batches of four chunks on PP 2: rank 0's warmup (2 + 3*2 + 1) is every forward, so
    no forward runs beside a backward and nothing is added."""
    job = resolve_job(qwen_moe(global_batch_size=32), layout(), 32)
    assert job.num_microbatches * job.virtual_stages == 8
    assert not memory.paired_steps(job, 0)
    assert memory.paired_steps(resolve_job(qwen_moe(), layout(), 32), 0)


def parts(job):
    """The saving's inputs, seconds per layer on stage 0."""
    cost = CostModel(CLUSTER)
    work = cost.work(job)
    links = cost.links(job)
    rate = links.gemm_flops.T[:, :, None]
    return cost, work, links, rate


def test_saving_is_bounded_by_what_each_stream_does():
    """The pairing hides at most the lighter stream's time; with the contention share at 0 and
    one stream idle, it saves nothing."""
    job = resolve_job(qwen_moe(), layout(), 32)
    cost, work, links, rate = parts(job)
    saved = _expert_overlap_saving(job, work, links, rate, 0.0)
    a2a = 4 * _dispatch(job, links)[None, :, None] / 2
    layer = work.moe_layer
    compute = (layer.forward.flops + layer.backward.flops + layer.recompute.flops) / rate \
        + layer.forward.mem_s + layer.backward.mem_s + layer.recompute.mem_s
    assert np.all(saved > 0)
    assert np.all(saved <= np.minimum(a2a, compute) + 1e-12)
    assert np.all(_expert_overlap_saving(job, work, links, rate, 0.1) < saved)
    single = preset_cluster("dgx-h100", num_nodes=1, precision="bf16")
    alone = resolve_job(qwen_moe(), layout(data_parallel_size=4, expert_model_parallel_size=1,
                                           overlap_moe_expert_parallel_comm=False), 8)
    assert CostModel(single).work(alone).moe_layer is None     # no pairing priced without the flag


def test_deferred_weight_gradients_let_the_dispatch_start_sooner():
    job = resolve_job(qwen_moe(), layout(), 32)
    delayed = resolve_job(qwen_moe(), layout(delay_wgrad_compute=True), 32)
    cost, work, links, rate = parts(job)
    assert np.all(_expert_overlap_saving(delayed, cost.work(delayed), links, rate, 0.1)
                  >= _expert_overlap_saving(job, work, links, rate, 0.1))


def test_the_overlap_shortens_the_iteration_by_its_hidden_dispatch():
    cost = CostModel(CLUSTER)
    w = qwen_moe()
    on = cost.time(resolve_job(w, layout(), 32))
    off = cost.time(resolve_job(w, layout(overlap_moe_expert_parallel_comm=False), 32))
    assert on.iteration_time_s < off.iteration_time_s
    assert on.breakdown.ep_comm_s < off.breakdown.ep_comm_s
    assert on.breakdown.compute_s == off.breakdown.compute_s
    # It hides no more than the dispatch and combine themselves.
    assert off.iteration_time_s - on.iteration_time_s <= off.breakdown.ep_comm_s


def test_the_search_keeps_the_flag_and_megatrons_rules():
    jobs = list(enumerate_layouts(qwen_moe(), 32, 8, {"overlap_moe_expert_parallel_comm": True}))
    assert jobs
    assert all(j.layout.overlap_moe_expert_parallel_comm and j.layout.ep > 1 for j in jobs)
    assert all(j.layout.recompute_granularity != "full" for j in jobs)
    assert all(j.layout.pp == 1 or j.virtual_stages > 1 for j in jobs)


def test_the_search_prefers_the_flag_where_megatron_accepts_it():
    """`preferred` (a recipe's setting carried to other layouts): on wherever Megatron's rules allow it,
    off on the layouts they forbid it on (EP 1, PP without interleaving, full recomputation), which a
    constraint would reject instead; every layout the free search yields is still yielded, once."""
    preferred = {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}
    free = list(enumerate_layouts(qwen_moe(), 8, 8))
    jobs = list(enumerate_layouts(qwen_moe(), 8, 8, preferred=preferred))
    assert len(jobs) == len(free)
    for job, plain in zip(jobs, free, strict=True):
        on = dataclasses.replace(plain.layout, **preferred)
        try:
            validate_layout(qwen_moe(), on)
            valid = True
        except Infeasible:
            valid = False
        assert job.layout == (on if valid else plain.layout)
    assert {j.layout.overlap_moe_expert_parallel_comm for j in jobs} == {True, False}
    assert any(j.layout.ep == 1 for j in jobs) and any(j.layout.recompute_granularity == "full" for j in jobs)
    with pytest.raises(PipetteError, match="both constrained and preferred"):
        list(enumerate_layouts(qwen_moe(), 32, 8, {"delay_wgrad_compute": False}, preferred=preferred))
    with pytest.raises(PipetteError, match="cannot prefer"):
        list(enumerate_layouts(qwen_moe(), 32, 8, preferred={"micro_batch_size": 2}))
