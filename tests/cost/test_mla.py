"""Multi-latent attention (--multi-latent-attention) and --qk-layernorm in the cost model: sizes of
the DeepSeek-V3-like preset, TP sharding of the down projections, the linears' and the attention
core's work, the latents kept for the backward, the TP collective before the up projections."""

import dataclasses

import pytest

from megatron_pipette.cost.compute import attention_input_width, roofline_layer
from megatron_pipette.cost.gemm import GemmCurve
from megatron_pipette.cost.memory import activation_bytes_per_layer
from megatron_pipette.cost.model import CostModel
from megatron_pipette.cost.parameters import dense_layer_parameters
from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import LayerProfile, ProfiledModel
from megatron_pipette.spec.layout import Infeasible, Layout
from megatron_pipette.spec.workload import Workload, workload_from_preset

UNIT = GemmCurve(log_table=None, half_dim=0.0)
DSV3 = workload_from_preset("deepseek-v3-like")
SMALL = Workload(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=128, global_batch_size=8,
                 multi_latent_attention=True, q_lora_rank=96, kv_lora_rank=64, qk_head_dim=32,
                 qk_pos_emb_head_dim=16, v_head_dim=24, qk_layernorm=True, ffn_hidden_size=512, swiglu=True,
                 add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0, normalization="RMSNorm",
                 precision="bf16")


def job(workload, **layout):
    return resolve_job(workload, Layout(**{"data_parallel_size": 1, **layout}))


def test_deepseek_v3_like_has_the_published_sizes():
    """DeepSeek-V3 technical report: 671B parameters (without the MTP module), 37B activated per
    token; 187M in each layer's attention."""
    assert round(DSV3.total_parameters() / 1e9) == 671
    routed_idle = sum(DSV3.moe_layer_pattern()) * (DSV3.num_experts - DSV3.moe_router_topk) \
        * DSV3.mlp_parameters(DSV3.moe_ffn)
    assert 37e9 <= DSV3.total_parameters() - routed_idle < 38e9
    assert round(DSV3.attention_parameters() / 1e6) == 187


def test_down_projections_and_latent_norms_are_whole_on_every_tp_rank():
    """Transformer Engine builds MLA's down projections 'duplicated': TP 8 splits only the up and
    output projections (and the MLP)."""
    w, h = SMALL, SMALL.hidden_size
    replicated = 2 * dense_layer_parameters(w, 2) - dense_layer_parameters(w, 1)
    assert replicated == h * 96 + h * (64 + 16) + 96 + 64 + 2 * h     # down projections, latent and layer norms


def test_linears_and_core_attention_work():
    """Forward GEMM FLOPs: 2 n (h q + q a dq + h (kv + r) + kv a (qk + v) + a v h) for the attention
    linears, the MLP's, and the causal half of scores (width dq) and weighted values (width dv)."""
    w = SMALL
    n, s, h, a, f = 128, 128, 256, 8, 512
    dq, dv = 32 + 16, 24
    linears = h * 96 + 96 * a * dq + h * (64 + 16) + 64 * a * (32 + dv) + a * dv * h + 3 * h * f
    core = a * s * s * (dq + dv)          # half of 2 a s^2 (dq + dv)
    layer = roofline_layer(job(w), 1e12, UNIT)
    assert layer.forward.flops == pytest.approx(2 * n * linears + core)


def test_kept_activations_hold_whole_latents_without_sequence_parallelism():
    """Per token, bf16, TP t: the layer norms' and the down and fc1 linears' inputs (4 h, sharded
    by SP only), the latents and their normed copies (q + kv + r, q + kv; sharded by SP only),
    every head's query and key and its value (a copy out of the up projection's output, which is
    freed: megatron-core's fused MLA RoPE, or .contiguous()), the output projection's input
    ((2 a dq + a v + a v) / t) and SwiGLU's fc1 output and fc2 input (3 f / t)."""
    w, e, n, h, a, f = SMALL, 2, 128, 256, 8, 512
    dq, dv = 48, 24
    latents = (96 + 64 + 16) + (96 + 64)
    heads = 2 * a * dq + a * dv + a * dv

    def expected(t, sp):
        return e * n * (4 * h // sp + latents // sp) + e * n * (heads + 3 * f) // t

    assert activation_bytes_per_layer(job(w)) == expected(1, 1)
    assert activation_bytes_per_layer(job(w, tensor_model_parallel_size=2)) == expected(2, 1)
    assert activation_bytes_per_layer(job(w, tensor_model_parallel_size=2, sequence_parallel=True)) == expected(2, 2)


def test_the_collective_before_the_attention_moves_latents():
    """Under SP the up projections all-gather the q and kv latents and the keys' rotary part, not
    the hidden state (DeepSeek-V3: 1536 + 512 + 64 = 2112 of 7168)."""
    assert attention_input_width(DSV3) == 2112
    assert attention_input_width(dataclasses.replace(DSV3, q_lora_rank=None)) == 7168 + 512 + 64
    assert attention_input_width(workload_from_preset("llama3-8b")) == 4096


def test_qk_layernorm_adds_its_norms_and_kept_inputs():
    llama = workload_from_preset("llama3-8b")
    normed = dataclasses.replace(llama, qk_layernorm=True)
    assert normed.attention_parameters() - llama.attention_parameters() == 2 * llama.head_dim   # RMSNorm weights
    assert activation_bytes_per_layer(job(normed)) > activation_bytes_per_layer(job(llama))


def test_rules_and_what_the_profile_does_not_cover():
    with pytest.raises(PipetteError, match="--multi-latent-attention and --group-query-attention"):
        dataclasses.replace(SMALL, group_query_attention=True, num_query_groups=2)
    with pytest.raises(Infeasible, match="--tp-comm-overlap with --multi-latent-attention"):
        job(SMALL, tensor_model_parallel_size=2, sequence_parallel=True, tp_comm_overlap=True)
    profile = LayerProfile(device_name="H100", rank=0, model=ProfiledModel(), layers=(), embedding=(), output_layer=())
    assert profile.covers(job(workload_from_preset("llama3-8b")))
    assert not profile.covers(job(SMALL))
    assert not profile.covers(job(dataclasses.replace(workload_from_preset("llama3-8b"), qk_layernorm=True)))


def test_mla_up_proj_recomputation_drops_query_key_value_and_redoes_the_up_projections():
    """megatron-core's MLASelfAttention under --recompute-modules mla_up_proj: the up projections and
    RoPE run under CheckpointWithoutOutput (inputs: the normed latents, kept anyway), whose outputs,
    every head's query, key and value, are freed after the core attention and rematerialised for its
    backward: the layer keeps (2 a dq + a v) / t fewer elements a token and its recompute redoes the
    q and kv up projections' GEMMs and the RoPE assembly (and, under SP, their latents' all-gather)."""
    e, n, a, dq, dv = 2, 128, 8, 48, 24
    kw = dict(recompute_granularity="selective", tensor_model_parallel_size=2)
    core, up = job(SMALL, recompute_modules=("core_attn",), **kw), job(SMALL, recompute_modules=(
        "core_attn", "mla_up_proj"), **kw)
    assert activation_bytes_per_layer(core) - activation_bytes_per_layer(up) == e * n * (2 * a * dq + a * dv) // 2
    bw = 1e12
    redone = roofline_layer(up, bw, UNIT).recompute.flops - roofline_layer(core, bw, UNIT).recompute.flops
    assert redone == pytest.approx(2 * n * (96 * a * dq + 64 * a * (32 + dv)) / 2)      # TP 2 splits the heads
    model = CostModel(preset_cluster("dgx-h100", num_nodes=1, precision="bf16"))
    for sp in (False, True):
        plain, again = (model.time(job(SMALL, recompute_modules=m, sequence_parallel=sp, data_parallel_size=4,
                                       **kw)).breakdown
                        for m in (("core_attn",), ("core_attn", "mla_up_proj")))
        assert again.recompute_s > plain.recompute_s
        assert (again.tp_comm_s > plain.tp_comm_s) == sp
