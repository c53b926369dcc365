"""Physics floors and the memory terms megatron-core 0.19 / Transformer Engine keep (issue: predictions
that agree with NVIDIA's H100 runs). Each test fails on the formula it replaced."""

import itertools

import numpy as np
import pytest

from megatron_pipette.cost.experts import moe_activation_bytes
from megatron_pipette.cost.gemm import fp8_curve, gemm_curve, gemm_work, linear_work
from megatron_pipette.cost.memory import attention_output_bytes, state_bytes_per_parameter
from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.hardware import lookup_gpu, preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset

H100 = lookup_gpu("H100")
GRID = [2.0 ** i for i in range(5, 17)]


@pytest.mark.parametrize("curve", [gemm_curve(H100, "bf16"), fp8_curve(H100, "bf16")], ids=["bf16", "fp8"])
def test_no_gemm_beats_the_large_gemm_rate_or_hbm(curve):
    """Every shape: efficiency at most the curve's own large-GEMM rate (the table clamped at 1), and
    time at least the bytes its operands and output move over the HBM bandwidth."""
    rate = H100.peak("bf16") * H100.large_gemm_efficiency["bf16"]
    for m, n, k in itertools.product(GRID, repeat=3):
        eff = curve(m, n, k)
        assert eff <= curve.speedup * (1 + 1e-12)
        seconds = 2 * m * n * k / (eff * rate)
        moved = curve.operand_bytes * (m * k + k * n) + curve.output_bytes * m * n
        assert seconds >= moved / H100.memory_bandwidth_Bps * (1 - 1e-9)


def test_small_k_gemm_is_memory_bound():
    """K = 128 cannot feed the tensor cores from HBM: writing the bf16 output alone caps it near
    0.55 of the large-GEMM rate (the measured table said above 1)."""
    assert gemm_curve(H100, "bf16")(16384, 16384, 128) < 0.6


def test_grouped_experts_read_their_own_weights():
    """32 experts of 128 rows each: 32 GEMMs that each read their weights, slower than one GEMM of
    4096 rows reading one weight matrix (the merged-rows price)."""
    curve = fp8_curve(H100, "bf16")
    grouped = linear_work(curve, 128, 4096, 7168, count=32)[0]
    merged = gemm_work(curve, 128, 4096, 7168, count=32)
    assert grouped > 1.5 * merged


def test_weight_gradient_accumulates_into_main_grad():
    """Gradient-accumulation fusion reads and writes the fp32 main_grad (8 bytes a weight): at few
    tokens the weight-gradient GEMM is bound by it."""
    curve = gemm_curve(H100, "bf16")
    plain, fused = linear_work(curve, 256, 4096, 4096)[2], linear_work(curve, 256, 4096, 4096, 8)[2]
    assert fused > 1.5 * plain


def moe_job(**over):
    w = workload_from_preset("mixtral-8x7b", **over)
    return resolve_job(w, Layout(expert_model_parallel_size=8, data_parallel_size=8))


def test_moe_keeps_no_expert_output():
    """megatron-core 0.19 applies the routing probability inside the weighted SwiGLU and unpermutes
    without it: per routed row fc1's input, fc1's output, fc2's input and the probability, no
    expert output (bf16: 2h + 6f + p bytes)."""
    job = moe_job()
    w = job.workload
    rows = job.tokens_per_microbatch * w.moe_router_topk
    routed = moe_activation_bytes(job) - 8 * job.tokens_per_microbatch * w.num_experts
    assert routed == rows * (2 * w.hidden_size + 6 * w.moe_ffn + 2)
    fp32_probs = moe_activation_bytes(moe_job(moe_router_dtype="fp32")) - moe_activation_bytes(job)
    assert fp32_probs == rows * 2


def test_fp8_delayed_scaling_keeps_the_attention_output_twice():
    """Flash attention keeps its bf16 output; under delayed scaling the projection keeps its FP8
    copy too (3 bytes), under tensorwise it reuses the bf16 one (2); without FP8 2."""
    llama = workload_from_preset("llama3-8b")
    assert attention_output_bytes(llama) == 2
    assert attention_output_bytes(workload_from_preset("llama3-8b", fp8="hybrid")) == 3
    assert attention_output_bytes(workload_from_preset("llama3-8b", fp8="hybrid", fp8_recipe="tensorwise")) == 2


def test_precision_aware_optimizer_and_fp8_param_gather_shrink_the_state():
    """Default bf16: 2 + 4 + 12. PAO with bf16 moments and grads (TE holds the fp32 master as 16-bit
    remainders): 2 + 2 + 6, no step copy. fp8-param-gather drops the 16-bit weights of the layers."""
    base = workload_from_preset("llama3-8b")
    assert state_bytes_per_parameter(base) == (2, 4, 12, 0)
    pao = workload_from_preset("llama3-8b", grad_reduce_in_bf16=True, use_precision_aware_optimizer=True,
                               main_grads_dtype="bf16", exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    assert state_bytes_per_parameter(pao) == (2, 2, 6, 0)
    with pytest.raises(PipetteError, match="--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"):
        workload_from_preset("llama3-8b", exp_avg_dtype="bf16")
    cluster = preset_cluster("dgx-h100", num_nodes=1)
    layout = Layout(data_parallel_size=8, use_distributed_optimizer=True)
    fp8 = CostModel(cluster).memory(resolve_job(workload_from_preset("llama3-8b", fp8="hybrid"), layout))
    gathered = CostModel(cluster).memory(resolve_job(
        workload_from_preset("llama3-8b", fp8="hybrid", fp8_param_gather=True), layout))
    layers = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    assert fp8.stages[0].weight_bytes - gathered.stages[0].weight_bytes == pytest.approx(2 * layers, rel=1e-3)


def test_sustained_rate_and_overlap_slow_an_h100_step():
    """The step GEMM fraction and the compute an overlapped collective takes both lengthen a
    step; with neither (an idealised GPU) the same job is faster."""
    import dataclasses

    from megatron_pipette.cost.execution import Execution
    cluster = preset_cluster("dgx-h100", num_nodes=2)
    ideal = dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, step_gemm_fraction=1.0))
    job = resolve_job(workload_from_preset("llama3-8b", global_batch_size=64),
                      Layout(data_parallel_size=16, use_distributed_optimizer=True, overlap_grad_reduce=True,
                             overlap_param_gather=True))
    real = CostModel(cluster).time(job).iteration_time_s
    assert CostModel(ideal).time(job).iteration_time_s < real
    assert CostModel(cluster, execution=Execution()).time(job).iteration_time_s < real
    assert np.isfinite(real)


def test_the_job_environment_sets_fragmentation_and_nvls():
    """NVIDIA's recipes launch with expandable allocator segments and NVLS off: less lost to
    fragmentation, no NVLS buffers."""
    from megatron_pipette.cost.memory import DEFAULT_OVERHEADS, EXPANDABLE_SEGMENTS_FRAGMENTATION, environment_overheads
    from megatron_pipette.spec.hardware import nvls_disabled
    assert environment_overheads({}) == DEFAULT_OVERHEADS
    expandable = environment_overheads({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert expandable.fragmentation == EXPANDABLE_SEGMENTS_FRAGMENTATION < DEFAULT_OVERHEADS.fragmentation
    assert nvls_disabled({"NCCL_NVLS_ENABLE": "0"}) and not nvls_disabled({})


def test_a_layout_within_the_memory_models_error_is_said_to_be_tight():
    """Fits by under 2%: the estimate says tight and the report warns instead of recommending it
    silently; by more, neither."""
    from megatron_pipette.cost.memory import MemoryEstimate, StageMemory
    from megatron_pipette.report.plans import tight_memory

    def estimate(total: int) -> MemoryEstimate:
        stage = StageMemory(stage=0, parameters=1, weight_bytes=total, gradient_bytes=0, optimizer_bytes=0,
                            activation_bytes=0, transient_bytes=0, overhead_bytes=0)
        return MemoryEstimate(stages=(stage,), capacity_bytes=1000)

    assert estimate(990).tight and "fits by 1.0%" in tight_memory(estimate(990))[0]
    assert not estimate(970).tight and tight_memory(estimate(970)) == []
    assert not estimate(1001).tight                    # does not fit at all: a misfit, not tight


def test_fp8_sequence_parallel_gathers_move_one_byte_an_element():
    """Under FP8 the all-gathers before QKV and fc1 (and their re-gathers in the backward) move the
    quantised input: with links this slow the TP time falls by most of those collectives' half."""
    import dataclasses

    from megatron_pipette.cost.execution import Execution
    from megatron_pipette.spec.hardware import uniform_level
    cluster = preset_cluster("dgx-h100", num_nodes=1)
    slow = dataclasses.replace(cluster, intra_node=(uniform_level(8, 1e9, 0.0),))
    layout = Layout(tensor_model_parallel_size=8, sequence_parallel=True)
    model = CostModel(slow, execution=Execution())
    bf16 = model.time(resolve_job(workload_from_preset("llama3-8b", global_batch_size=8), layout)).breakdown.tp_comm_s
    fp8 = model.time(resolve_job(workload_from_preset("llama3-8b", global_batch_size=8, fp8="hybrid"),
                                 layout)).breakdown.tp_comm_s
    # forward: 2 of 4 collectives halve; backward: 2 re-gathers of 4 exposed-or-hidden ones
    assert 0.6 * bf16 < fp8 < 0.85 * bf16


def test_the_measured_tables_hold_no_efficiency_above_the_large_gemm_rate():
    """data/gemm_efficiency.json itself is clamped (benchmarks/calibration/gemm_table.py writes it so): it had
    539 nodes above 1.0, at shapes HBM cannot feed."""
    from megatron_pipette.cost.gemm import _gemm_data
    for gpu in _gemm_data()["gpus"].values():
        for table in gpu.get("tables", {}).values():
            assert np.max(table) <= 1.0
