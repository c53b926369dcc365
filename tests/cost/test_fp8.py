"""FP8 (--fp8-format) in the cost model: the layers' linears at the FP8 rate, the attention and the
output layer in 16 bits, TE's FP8 weight copies and FP8-kept linear inputs in memory."""

import dataclasses

import pytest

from megatron_pipette.cost.compute import roofline_layer
from megatron_pipette.cost.gemm import fp8_curve, gemm_curve
from megatron_pipette.cost.model import CostModel
from megatron_pipette.cost.parameters import stage_parameters
from megatron_pipette.errors import PipetteError
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
    with pytest.raises(PipetteError, match="--fp8-recipe must be one of delayed, tensorwise"):
        dataclasses.replace(FP8, fp8_recipe="mxfp8")
