"""FP8 (--fp8-format) and FP4 (--fp4-format) in the cost model: the layers' linears at the FP8 or FP4
rate, the attention and the output layer in 16 bits, TE's quantised weight copies and kept linear
inputs in memory, the block-scaled recipes' scales and quantisation passes."""

import dataclasses

import pytest

from megatron_pipette.cost.compute import roofline_layer
from megatron_pipette.cost.gemm import fp8_cast_bytes, fp8_curve, gemm_curve
from megatron_pipette.cost.memory import activation_bytes_per_layer, fp8_weight_copy_bytes
from megatron_pipette.cost.model import CostModel
from megatron_pipette.cost.parameters import stage_parameters
from megatron_pipette.errors import PipetteError
from megatron_pipette.report.plans import precision_priced
from megatron_pipette.spec.hardware import lookup_gpu, preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset

H100 = lookup_gpu("H100")
LLAMA = workload_from_preset("llama3-8b")
FP8 = dataclasses.replace(LLAMA, fp8="hybrid")


def job(workload, **layout):
    return resolve_job(workload, Layout(**{"data_parallel_size": 1, **layout}))


def test_fp8_gemms_run_at_the_measured_fp8_rate_against_bf16s():
    """H100: FP8 peak 2x BF16's, large GEMMs at 0.733 and 0.795 of peak (measured): an 8192^3 FP8
    GEMM is 1.84x the BF16 one, and a GEMM's shape efficiency comes from the FP8 table."""
    curve = fp8_curve(H100, "bf16")
    eff = H100.large_gemm_efficiency
    assert (eff["fp8"], round(eff["bf16"], 3)) == (0.733, 0.795)
    assert curve.speedup == pytest.approx(H100.peak("fp8") / H100.peak("bf16") * eff["fp8"] / eff["bf16"])
    assert curve(8192, 8192, 8192) == pytest.approx(curve.speedup * gemm_curve(H100, "fp8")(8192, 8192, 8192))


def test_only_the_linears_speed_up():
    """The attention core stays 16-bit: an FP8 layer's GEMM work shrinks by less than the FP8 speed-up."""
    bf16 = roofline_layer(job(LLAMA), H100.memory_bandwidth_Bps, gemm_curve(H100, "bf16"))
    fp8 = roofline_layer(job(FP8), H100.memory_bandwidth_Bps, gemm_curve(H100, "bf16"),
                         linear=fp8_curve(H100, "bf16"))
    ratio = bf16.forward.flops / fp8.forward.flops
    assert 1.2 < ratio < fp8_curve(H100, "bf16").speedup
    assert fp8.forward.mem_s > bf16.forward.mem_s            # the casts to FP8


def test_fp8_memory_weight_copies_and_inputs():
    """+2 bytes per layer parameter (FP8 weight and transpose); the linears keep 1-byte inputs."""
    model = CostModel(preset_cluster("dgx-h100", num_nodes=1))
    base, fp8 = (model.memory(job(w, tensor_model_parallel_size=8, sequence_parallel=True)).stages[0]
                 for w in (LLAMA, FP8))
    in_layers = stage_parameters(job(FP8, tensor_model_parallel_size=8, sequence_parallel=True)).dense_in_layers[0]
    assert fp8.weight_bytes - base.weight_bytes == 2 * in_layers
    assert fp8.activation_bytes < base.activation_bytes


def test_fp8_is_faster_on_h100_and_refused_where_there_are_no_fp8_tensor_cores():
    h100 = CostModel(preset_cluster("dgx-h100", num_nodes=1))
    layout = dict(tensor_model_parallel_size=8, sequence_parallel=True)
    assert h100.time(job(FP8, **layout)).iteration_time_s < 0.85 * h100.time(job(LLAMA, **layout)).iteration_time_s
    a100 = CostModel(preset_cluster("dgx-a100", num_nodes=1))
    with pytest.raises(PipetteError, match="--fp8-format: A100-80GB has no FP8 tensor cores"):
        a100.time(job(FP8, **layout))


def test_fp8_rules():
    with pytest.raises(PipetteError, match="--fp8-format hybrid needs --bf16 or --fp16"):
        dataclasses.replace(LLAMA, fp8="hybrid", precision="fp32")
    with pytest.raises(PipetteError, match="--fp8-recipe must be one of delayed, tensorwise, mxfp8, got 'blockwise'"):
        dataclasses.replace(FP8, fp8_recipe="blockwise")


B200 = lookup_gpu("B200")
MXFP8 = dataclasses.replace(LLAMA, fp8="e4m3", fp8_recipe="mxfp8")
TENSORWISE = dataclasses.replace(LLAMA, fp8="e4m3", fp8_recipe="tensorwise")


def test_mxfp8_gemms_run_at_the_fp8_rate_and_read_their_block_scales():
    """MXFP8 GEMMs: the FP8 peak and curve (one dense FP8 figure on Blackwell), operands of 1 byte
    plus one E8M0 scale per 32 elements."""
    mx, tensorwise = fp8_curve(B200, "bf16", "mxfp8"), fp8_curve(B200, "bf16", "tensorwise")
    assert mx.speedup == tensorwise.speedup == pytest.approx(B200.large_gemm_rate("fp8") / B200.large_gemm_rate("bf16"))
    assert (mx.operand_bytes, tensorwise.operand_bytes) == (1 + 1 / 32, 1)
    assert mx(8192, 8192, 8192) == tensorwise(8192, 8192, 8192)


def test_mxfp8_is_refused_without_block_scaled_tensor_cores():
    with pytest.raises(PipetteError, match="--fp8-recipe mxfp8: H100-80GB has no block-scaled"):
        fp8_curve(H100, "bf16", "mxfp8")
    h100 = CostModel(preset_cluster("dgx-h100", num_nodes=1))
    with pytest.raises(PipetteError, match="--fp8-recipe mxfp8: H100-80GB"):
        h100.time(job(MXFP8, tensor_model_parallel_size=8, sequence_parallel=True))


def test_mxfp8_quantises_both_directions_from_one_read():
    """Per element: per-tensor reads 2 bytes and writes 1; MXFP8 writes a rowwise and a columnwise
    copy, each with its scales: 2 + 2 x 1.03125."""
    linears = [(4096, 1024, 512)]
    assert fp8_cast_bytes("tensorwise", linears) == (3 * 4096 * 512, 3 * 4096 * 1024)
    assert fp8_cast_bytes("mxfp8", linears) == (4.0625 * 4096 * 512, 4.0625 * 4096 * 1024)
    assert fp8_cast_bytes(None, linears) == (0.0, 0.0)
    layout = dict(tensor_model_parallel_size=8, sequence_parallel=True)
    mx, tw = (roofline_layer(job(w, **layout), B200.memory_bandwidth_Bps, gemm_curve(B200, "bf16"),
                             linear=fp8_curve(B200, "bf16", w.fp8_recipe)) for w in (MXFP8, TENSORWISE))
    x = job(MXFP8, **layout)
    n, h, f = x.tokens_per_microbatch, LLAMA.hidden_size, LLAMA.ffn_hidden_size
    qkv = h // 8 * (LLAMA.num_attention_heads + 2 * LLAMA.num_query_groups) // LLAMA.num_attention_heads
    inputs = n * (h + h // 8 + h + f // 8)             # QKV's, proj's (TP-sharded), fc1's and fc2's inputs
    outputs = n * (qkv + h + 2 * f // 8 + h)           # their output gradients (fc1: SwiGLU's two halves)
    assert mx.forward.mem_s - tw.forward.mem_s == pytest.approx(1.0625 * inputs / B200.memory_bandwidth_Bps)
    assert mx.backward.mem_s - tw.backward.mem_s == pytest.approx(1.0625 * outputs / B200.memory_bandwidth_Bps)


def test_mxfp8_memory_block_scales_on_weight_copies_and_kept_inputs():
    """Weight copies 2 x 1.03125 bytes a layer parameter (rowwise and columnwise, on any GPU), the
    kept linear inputs 1.03125 bytes an element (the columnwise copy): 1/32 more than per-tensor
    FP8's, whose weight copy is one byte on Blackwell (no transpose)."""
    model = CostModel(preset_cluster("dgx-b200", num_nodes=1))
    layout = dict(tensor_model_parallel_size=8, sequence_parallel=True)
    tw, mx = (model.memory(job(w, **layout)).stages[0] for w in (TENSORWISE, MXFP8))
    in_layers = int(stage_parameters(job(MXFP8, **layout)).dense_in_layers[0])
    assert mx.weight_bytes - tw.weight_bytes == round(2 * 1.03125 * in_layers) - in_layers
    x = job(MXFP8, **layout)
    n, h, f = x.tokens_per_microbatch, LLAMA.hidden_size, LLAMA.ffn_hidden_size
    kept = 2 * n * h // 8 + n * f // 8                 # QKV's and fc1's inputs (SP), fc2's (TP)
    assert activation_bytes_per_layer(x) - activation_bytes_per_layer(job(TENSORWISE, **layout)) == \
        pytest.approx(kept / 32, abs=2)


def test_mxfp8_param_gather_moves_16_bit_weights_into_the_gradient_buffer():
    """--fp8-param-gather under MXFP8 (with --reuse-grad-buf-for-mxfp8-param-ag) keeps MXFP8 weights
    in place of the 16-bit ones but all-gathers in 16 bits: the DP time is MXFP8's without it;
    per-tensor FP8 gathers 1 byte."""
    model = CostModel(preset_cluster("dgx-b200", num_nodes=2))
    layout = dict(tensor_model_parallel_size=8, sequence_parallel=True, data_parallel_size=2,
                  use_distributed_optimizer=True)
    gather = dict(fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True)
    mx_gather = dataclasses.replace(MXFP8, **gather)
    assert (MXFP8.param_gather_bytes, mx_gather.param_gather_bytes) == (None, None)
    assert dataclasses.replace(TENSORWISE, fp8_param_gather=True).param_gather_bytes == 1

    def dp(w):
        return model.time(job(w, **layout)).breakdown.dp_comm_exposed_s

    assert dp(mx_gather) == dp(MXFP8)
    assert dp(dataclasses.replace(TENSORWISE, fp8_param_gather=True)) < dp(TENSORWISE)
    in_layers = int(stage_parameters(job(MXFP8, **layout)).dense_in_layers[0])
    plain, kept = (model.memory(job(w, **layout)).stages[0].weight_bytes for w in (MXFP8, mx_gather))
    assert plain - kept == 2 * in_layers                # the 16-bit weights are gone


def test_per_tensor_fp8_keeps_no_weight_transpose_on_blackwell():
    """Blackwell's FP8 GEMMs take either operand layout (compute capability 10.x: TE's
    is_non_tn_fp8_gemm_supported), so a per-tensor FP8 weight is one byte a parameter there, where
    Hopper keeps its transpose too; MXFP8 keeps its rowwise and columnwise copies on both."""
    assert lookup_gpu("GB200").fp8_gemm_any_layout and lookup_gpu("GB300").fp8_gemm_any_layout
    assert not H100.fp8_gemm_any_layout and not lookup_gpu("H200").fp8_gemm_any_layout
    assert (fp8_weight_copy_bytes("tensorwise"), fp8_weight_copy_bytes("tensorwise", any_layout=True)) == (2, 1)
    assert fp8_weight_copy_bytes("delayed", any_layout=True) == 1
    assert fp8_weight_copy_bytes("mxfp8", any_layout=True) == fp8_weight_copy_bytes("mxfp8") == 2 * 1.03125
    layout = dict(tensor_model_parallel_size=8, sequence_parallel=True, data_parallel_size=2,
                  use_distributed_optimizer=True)
    gathered = dataclasses.replace(TENSORWISE, fp8_param_gather=True)
    in_layers = int(stage_parameters(job(gathered, **layout)).dense_in_layers[0])
    for preset, gpu in (("dgx-h100", H100), ("dgx-b200", B200)):
        model = CostModel(preset_cluster(preset, num_nodes=2))
        bf16, plain, kept = (model.memory(job(w, **layout)).stages[0].weight_bytes
                             for w in (LLAMA, TENSORWISE, gathered))
        copies = 1 if gpu.fp8_gemm_any_layout else 2
        assert plain - bf16 == copies * in_layers            # the FP8 cache beside the 16-bit weights
        assert kept - bf16 == (copies - 2) * in_layers       # the FP8 weights in their place


def test_mxfp8_param_gather_rules():
    with pytest.raises(PipetteError, match="--fp8-param-gather with --fp8-recipe mxfp8 is priced with "
                                           "--reuse-grad-buf-for-mxfp8-param-ag only"):
        dataclasses.replace(MXFP8, fp8_param_gather=True)
    with pytest.raises(PipetteError, match="--reuse-grad-buf-for-mxfp8-param-ag needs --fp8-param-gather"):
        dataclasses.replace(MXFP8, reuse_grad_buf_for_mxfp8_param_ag=True)
    with pytest.raises(PipetteError, match="--reuse-grad-buf-for-mxfp8-param-ag needs"):
        dataclasses.replace(TENSORWISE, fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True)


NVFP4 = dataclasses.replace(LLAMA, fp4="e2m1")


def test_nvfp4_gemms_run_at_the_fp4_peak_on_the_fp8_curve():
    """NVFP4 GEMMs: the FP4 peak's large-GEMM rate over bf16's, the FP8 table's shape, operands of
    half a byte plus an E4M3 scale per 16 elements."""
    fp4, fp8 = fp8_curve(B200, "bf16", "nvfp4"), fp8_curve(B200, "bf16", "tensorwise")
    assert fp4.speedup == pytest.approx(B200.large_gemm_rate("fp4") / B200.large_gemm_rate("bf16"))
    assert fp4.operand_bytes == 0.5 + 1 / 16
    assert fp4(8192, 8192, 8192) == pytest.approx(fp8(8192, 8192, 8192) * fp4.speedup / fp8.speedup)


def test_nvfp4_is_refused_where_the_catalog_has_no_fp4_peak():
    for gpu in (H100, None):
        with pytest.raises(PipetteError, match="--fp4-format: .* has no FP4 tensor cores in the catalog"):
            fp8_curve(gpu, "bf16", "nvfp4")


def test_nvfp4_quantises_with_an_amax_pass_and_both_directions():
    """Per element: the amax of the Hadamard-transformed tensor reads it (2 bytes), the fused kernel
    reads it again and writes rowwise and columnwise E2M1 with their scales (2 x 0.5625)."""
    assert fp8_cast_bytes("nvfp4", [(4096, 1024, 512)]) == (5.125 * 4096 * 512, 5.125 * 4096 * 1024)


def test_nvfp4_memory_and_parameter_gather():
    """Weight copies 2 x 0.5625 bytes a layer parameter; kept linear inputs 0.5625 bytes an element;
    --fp4-param-gather drops the 16-bit weights and gathers 0.5625 bytes a layer parameter."""
    model = CostModel(preset_cluster("dgx-b200", num_nodes=2))
    layout = dict(tensor_model_parallel_size=8, sequence_parallel=True, data_parallel_size=2,
                  use_distributed_optimizer=True)
    base, fp4 = (model.memory(job(w, **layout)).stages[0] for w in (LLAMA, NVFP4))
    in_layers = int(stage_parameters(job(NVFP4, **layout)).dense_in_layers[0])
    assert fp4.weight_bytes - base.weight_bytes == round(1.125 * in_layers)
    x = job(NVFP4, **layout)
    n, h, f = x.tokens_per_microbatch, LLAMA.hidden_size, LLAMA.ffn_hidden_size
    kept = 2 * n * h // 8 + n * f // 8                 # QKV's and fc1's inputs (SP), fc2's (TP)
    assert activation_bytes_per_layer(job(LLAMA, **layout)) - activation_bytes_per_layer(x) == \
        pytest.approx(kept * (2 - 0.5625), abs=2)
    gathered = dataclasses.replace(NVFP4, fp4_param_gather=True)
    assert (NVFP4.param_gather_bytes, gathered.param_gather_bytes) == (None, 0.5625)
    assert fp4.weight_bytes - model.memory(job(gathered, **layout)).stages[0].weight_bytes == 2 * in_layers

    def dp(w):
        return model.time(job(w, **layout)).breakdown.dp_comm_exposed_s

    assert dp(gathered) < dp(dataclasses.replace(TENSORWISE, fp8_param_gather=True)) < dp(NVFP4)


def test_nvfp4_is_faster_than_fp8_on_b200_and_headed_so():
    b200 = CostModel(preset_cluster("dgx-b200", num_nodes=1))
    layout = dict(tensor_model_parallel_size=8, sequence_parallel=True)
    assert b200.time(job(NVFP4, **layout)).iteration_time_s < b200.time(job(TENSORWISE, **layout)).iteration_time_s
    assert precision_priced(NVFP4) == "bf16 with FP4 GEMMs (--fp4-format e2m1, --fp4-recipe nvfp4)"


def test_fp4_rules():
    with pytest.raises(PipetteError, match="--fp4-format e2m1 and --fp8-format hybrid exclude each other"):
        dataclasses.replace(NVFP4, fp8="hybrid")
    with pytest.raises(PipetteError, match="--fp4-format e2m1 needs --bf16"):
        dataclasses.replace(NVFP4, precision="fp16")
    with pytest.raises(PipetteError, match="--fp4-format must be one of e2m1, got 'e3m0'"):
        dataclasses.replace(NVFP4, fp4="e3m0")
    with pytest.raises(PipetteError, match="--fp4-recipe must be one of nvfp4, got 'custom'"):
        dataclasses.replace(NVFP4, fp4_recipe="custom")
    with pytest.raises(PipetteError, match="--fp4-param-gather needs --fp4-format"):
        dataclasses.replace(LLAMA, fp4_param_gather=True)
