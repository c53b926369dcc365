"""GPT-OSS's attention and experts: sliding windows on some layers (--window-size,
--window-attn-skip-freq), attention sinks (--softmax-type learnable) and quick-GeGLU experts
(--quick-geglu), against megatron-core 0.19's own rules."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_pipette.cost import compute
from megatron_pipette.cost.compute import ATTENTION_TILE, stage_work, windowed_share
from megatron_pipette.errors import Infeasible, PipetteError, UnrunnableFlags
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import Workload


def gpt_oss(**kw):
    """GPT-OSS 120B's shapes, cut to 8 layers."""
    base = dict(num_layers=8, hidden_size=2880, num_attention_heads=64, group_query_attention=True,
                num_query_groups=8, kv_channels=64, seq_length=4096, global_batch_size=64, precision="bf16",
                normalization="RMSNorm", position_embedding_type="rope", attention_dropout=0.0, hidden_dropout=0.0,
                num_experts=16, moe_router_topk=4, moe_ffn_hidden_size=2880, ffn_hidden_size=2880,
                moe_token_dispatcher_type="alltoall", quick_geglu=True)
    return Workload(**{**base, **kw})


@pytest.mark.megatron
@pytest.mark.parametrize("freq", [None, 1, 2, 3, "[1,0]*4", "[0]*7+[1]"])
def test_windowed_layers_are_megatrons(freq):
    """megatron/core/transformer/utils.py is_layer_window_attention, called with Megatron's parsed
    value (moe_freq_type) and 1-based layer numbers."""
    from megatron.core.transformer.utils import is_layer_window_attention
    from megatron.training.arguments import moe_freq_type, tuple_type

    w = gpt_oss(window_size="127,0", window_attn_skip_freq=freq)
    parsed = None if freq is None else moe_freq_type(freq)
    assert w.window_layer_pattern() == tuple(
        is_layer_window_attention(tuple_type("127,0"), parsed, n) for n in range(1, 9))


def test_no_window_or_an_unbounded_one_keeps_full_attention():
    assert not any(gpt_oss().window_layer_pattern())
    assert not any(gpt_oss(window_size="-1,0").window_layer_pattern())
    assert gpt_oss(window_size="(127, 0)").window == 127


@pytest.mark.parametrize("size", ["127", "a,0", "1,2,3", "-2,0"])
def test_a_malformed_window_names_the_flag(size):
    with pytest.raises(PipetteError, match="--window-size"):
        gpt_oss(window_size=size)


def test_a_malformed_skip_pattern_names_the_flag():
    with pytest.raises(PipetteError, match="--window-attn-skip-freq"):
        gpt_oss(window_size="127,0", window_attn_skip_freq="[1,0]*3")    # 6 entries for 8 layers


def test_windowed_share_counts_whole_blocks():
    """A window of 127 earlier keys: each 128-query block needs its own key block and the one
    before; a causal kernel computes 32 x 33 / 2 blocks at s = 4096."""
    assert windowed_share(4096, 127) == pytest.approx(63 / 528)
    assert windowed_share(4096, 4096) == 1.0
    assert windowed_share(ATTENTION_TILE, 0) == 1.0


@given(st.integers(1, 16384), st.integers(0, 20000), st.integers(0, 20000))
def test_windowed_share_grows_with_the_window_up_to_causal(s, w1, w2):
    small, large = sorted((w1, w2))
    assert 0 < windowed_share(s, small) <= windowed_share(s, large) <= 1.0


def _work(workload, **layout):
    job = resolve_job(workload, Layout(data_parallel_size=1, **layout))
    return stage_work(job, preset_cluster("dgx-h100", num_nodes=1, precision="bf16"))


def test_windowed_layers_compute_only_their_blocks():
    """Half the layers windowed: the stage computes less attention by exactly half its layers'
    full-minus-windowed cores, forward and backward; the linears are untouched."""
    full, half = _work(gpt_oss()), _work(gpt_oss(window_size="127,0", window_attn_skip_freq=2))
    every = _work(gpt_oss(window_size="127,0"))
    saved_half = full.forward.flops - half.forward.flops
    saved_all = full.forward.flops - every.forward.flops
    assert (saved_half > 0).all()
    np.testing.assert_allclose(saved_all, 2 * saved_half)
    np.testing.assert_allclose(full.backward.flops - every.backward.flops,
                               2 * (full.backward.flops - half.backward.flops))
    np.testing.assert_allclose(half.forward.mem_s, full.forward.mem_s)


def test_recomputation_redoes_the_windowed_core():
    """Full recomputation redoes the whole layer: a windowed layer's smaller core, again."""
    kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    full, windowed = _work(gpt_oss(), **kw), _work(gpt_oss(window_size="127,0"), **kw)
    np.testing.assert_allclose(full.recompute.flops - windowed.recompute.flops,
                               full.forward.flops - windowed.forward.flops)


def test_unfused_attention_computes_every_score_whatever_the_window():
    """Megatron's local attention masks a full s x s score matrix (FusedScaleMaskSoftmax's window)."""
    kw = dict(attention_backend="unfused", num_experts=None, add_bias_linear=False)
    np.testing.assert_allclose(_work(gpt_oss(**kw)).forward.flops,
                               _work(gpt_oss(window_size="127,0", **kw)).forward.flops)


def test_context_parallelism_with_a_window_is_refused():
    w = gpt_oss(window_size="127,0", window_attn_skip_freq=2)
    with pytest.raises(Infeasible, match="--window-size"):
        resolve_job(w, Layout(context_parallel_size=2, data_parallel_size=1))


def test_quick_geglu_experts_have_swiglus_shapes():
    """Both set gated_linear_unit (training/argument_utils.py): fc1 doubled."""
    quick = gpt_oss(add_bias_linear=False)
    swiglu = gpt_oss(add_bias_linear=False, quick_geglu=False, swiglu=True)
    assert quick.gated_linear_unit and quick.total_parameters() == swiglu.total_parameters()
    np.testing.assert_allclose(_work(quick).forward.flops, _work(swiglu).forward.flops)


def test_quick_geglu_excludes_swiglu_and_takes_biases_in_experts_only():
    """Megatron asserts `not args.swiglu` with --quick-geglu; the routed experts' weighted quick-GeGLU
    takes a bias (fused_bias_geglu.weighted_bias_quick_geglu_impl), a dense MLP's fused one does not
    (transformer/mlp.py: "Only support fusion of gelu and swiglu")."""
    with pytest.raises(PipetteError, match="--quick-geglu and --swiglu"):
        gpt_oss(swiglu=True)
    assert gpt_oss(add_bias_linear=True).add_bias_linear
    with pytest.raises(UnrunnableFlags, match="Only support fusion of gelu and swiglu"):
        gpt_oss(add_bias_linear=True, moe_layer_freq="[0]+[1]*7")
    assert gpt_oss(add_bias_linear=True, bias_gelu_fusion=False, moe_layer_freq="[0]+[1]*7")


def test_learnable_softmax_adds_one_offset_per_head_and_layer():
    """TEDotProductAttention's softmax_offset: one parameter per attention head (split over TP)."""
    vanilla, sinks = gpt_oss(), gpt_oss(softmax_type="learnable")
    assert sinks.total_parameters() - vanilla.total_parameters() == 8 * 64
    assert gpt_oss(softmax_type="off-by-one").total_parameters() == vanilla.total_parameters()
    with pytest.raises(PipetteError, match="--softmax-type"):
        gpt_oss(softmax_type="sigmoid")


def _saved_storages(clamp):
    """Bytes of each storage megatron-core's fused weighted quick-GeGLU keeps for its backward."""
    import torch
    from megatron.core.fusions.fused_bias_geglu import weighted_bias_quick_geglu_impl

    fc1_output = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True) * 1.0
    kept = {}

    def pack(tensor):
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        weighted_bias_quick_geglu_impl(fc1_output, None, torch.rand(64, 1), False, 1.0, clamp)
    return sorted(size for size in kept.values() if size >= fc1_output.untyped_storage().nbytes())


@pytest.mark.megatron
def test_the_clamp_keeps_a_concatenated_copy_as_megatron_core_does():
    """weighted_bias_quick_geglu_impl with a clamp value keeps the clamped halves' concatenation
    beside fc1's output (which the clamps' own backward holds): one fc1 output more."""
    assert len(_saved_storages(7.0)) == len(_saved_storages(None)) + 1


def _clamp_terms(workload, **layout):
    from megatron_pipette.cost.experts import clamp_half_bytes, moe_activation_bytes, moe_backward_bytes

    job = resolve_job(workload, Layout(data_parallel_size=1, **layout))
    return job, clamp_half_bytes(job), moe_activation_bytes(job, job.layout.selective_modules), \
        moe_backward_bytes(job)


def test_the_clamp_is_priced_where_megatron_core_runs_its_passes():
    """Fused quick-GeGLU experts: two clamps and a concatenation (8 halves moved forward, 10 back,
    8 again where moe_act recomputes), the copy kept unless moe_act drops it; the fused SwiGLU ignores
    the clamp, so nothing changes there."""
    from megatron_pipette.cost.experts import routed_rows

    plain, clamped = gpt_oss(), gpt_oss(activation_func_clamp_value=7.0)
    job, half, kept, backward = _clamp_terms(clamped)
    assert half == 2 * routed_rows(job) * 2880
    _, none, kept0, backward0 = _clamp_terms(plain)
    assert none == 0 and kept - kept0 == round(2 * half) and backward - backward0 == round(2 * half)
    bandwidth = preset_cluster("dgx-h100", num_nodes=1, precision="bf16").memory_bandwidth_Bps
    base, more = _work(plain), _work(clamped)
    assert more.moe_layers.sum() == 8
    np.testing.assert_allclose(more.forward.flops, base.forward.flops)
    extra_f = (more.forward.mem_s - base.forward.mem_s)
    extra_b = (more.backward.mem_s - base.backward.mem_s)
    np.testing.assert_allclose(extra_b, extra_f * 10 / 8)
    assert (extra_f > 0).all()
    np.testing.assert_allclose(extra_f.sum(), 8 * 8 * half / bandwidth, rtol=1e-9)

    act = dict(recompute_granularity="selective", recompute_modules=("moe_act",))
    _, _, kept_act, backward_act = _clamp_terms(clamped, **act)
    _, _, kept_act0, backward_act0 = _clamp_terms(plain, **act)
    assert kept_act == kept_act0 and backward_act - backward_act0 == round(4 * half)
    redo, redo0 = _work(clamped, **act).recompute.mem_s, _work(plain, **act).recompute.mem_s
    np.testing.assert_allclose((redo - redo0).sum(), 8 * 8 * half / bandwidth, rtol=1e-9)

    swiglu = gpt_oss(quick_geglu=False, swiglu=True, add_bias_linear=False)
    assert _clamp_terms(dataclasses.replace(swiglu, activation_func_clamp_value=7.0))[1:] == _clamp_terms(swiglu)[1:]


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True, "7"])
def test_a_bad_clamp_value_names_the_flag(value):
    with pytest.raises(PipetteError, match="--activation-func-clamp-value"):
        gpt_oss(activation_func_clamp_value=value)


def test_yarn_runs_rope_unfused_where_its_factor_scales_it():
    """Transformer Engine's fused RoPE takes no scale: YaRN with a concentration factor other than 1
    runs megatron-core's unfused RoPE, 12 passes of the query and key heads forward where the kernel
    moves 2, and 10 backward where the elementwise rule gives it 4; at factor 1 it is RoPE's price."""
    rope, yarn = gpt_oss(), gpt_oss(position_embedding_type="yarn", rotary_scaling_factor=32.0)
    assert yarn.rope_concentration_factor == pytest.approx(0.1 * np.log(32) + 1)
    assert gpt_oss(position_embedding_type="yarn").rope_concentration_factor == 1.0
    base, more = _work(rope), _work(yarn)
    np.testing.assert_allclose(_work(gpt_oss(position_embedding_type="yarn")).forward.mem_s, base.forward.mem_s)
    bandwidth = preset_cluster("dgx-h100", num_nodes=1, precision="bf16").memory_bandwidth_Bps
    heads = 4096 * (64 + 8) * 64 * 2        # one micro-batch's query and key heads, bf16
    np.testing.assert_allclose((more.forward.mem_s - base.forward.mem_s).sum(), 8 * 10 * heads / bandwidth)
    np.testing.assert_allclose((more.backward.mem_s - base.backward.mem_s).sum(), 8 * 6 * heads / bandwidth)
    with pytest.raises(PipetteError, match="--mscale-all-dim"):
        gpt_oss(position_embedding_type="yarn", rotary_scaling_factor=32.0, mscale_all_dim=-10 / np.log(32))


def test_a_profiled_layer_loses_the_windows_share_of_its_measured_time():
    """A dense layer profiled whole at full attention, 300x faster than the roofline prices it (a
    device whose GEMM rate says little about its layer: a CPU): the window takes from it the share
    of the roofline layer the skipped blocks are, not the roofline's seconds (which made an
    iteration time of -0.18 s), forward and backward."""
    from megatron_pipette.cost.compute import roofline_embedding, roofline_output
    from megatron_pipette.cost.model import CostModel
    from megatron_pipette.spec.layer_profile import LayerProfile, ProfiledModel, ProfileEntry
    from megatron_pipette.spec.workload import workload_from_preset

    cluster = dataclasses.replace(preset_cluster("dgx-h100", num_nodes=1, gpus_per_node=1),
                                  gemm_flops=np.array([1e11]))
    rate = cluster.step_gemm_flops[0]

    def entry(fwd, bwd):
        return ProfileEntry(tensor_model_parallel_size=1, micro_batch_size=1, forward_s=fwd, backward_s=bwd,
                            activation_bytes=1)
    profile = LayerProfile(device_name="x", rank=0, layers=(entry(1e-3, 2e-3),), embedding=(entry(0.0, 0.0),),
                           output_layer=(entry(0.0, 0.0),), model=ProfiledModel())
    layout = Layout(data_parallel_size=1)

    def layers_s(window, measured):
        """(forward, backward) seconds of the stage's layers: without the embedding and output layer."""
        job = resolve_job(workload_from_preset("gpt3-1.3b", global_batch_size=1, window_size=window), layout)
        work = stage_work(job, cluster, profile if measured else None)
        bw = cluster.memory_bandwidth_Bps
        ends = (0, 0) if measured else [sum(getattr(end, name).seconds(rate) for end in (
            roofline_embedding(job, bw), roofline_output(job, bw, compute.gemm_curve(cluster.gpu, "bf16"))))
            for name in ("forward", "backward")]
        return work.forward.seconds(rate)[0, 0] - ends[0], work.backward.seconds(rate)[0, 0] - ends[1]

    roofline = np.array(layers_s("127,0", False)) / np.array(layers_s(None, False))
    measured = np.array(layers_s("127,0", True)) / np.array(layers_s(None, True))
    assert (roofline < 1).all()
    np.testing.assert_allclose(measured, roofline, rtol=1e-12)
    job = resolve_job(workload_from_preset("gpt3-1.3b", global_batch_size=1, window_size="127,0"), layout)
    assert CostModel(cluster, profile=profile).time(job).iteration_time_s > 0
