"""benchmarks/device/cost_check.py, the GPU check: the planner prices every shape it times and the
training step it runs (given the very flags Megatron gets), and it reads Megatron's log as
Megatron writes it. Runs on CPU; the measurements themselves need the GPU."""

import math
import statistics
import sys
from pathlib import Path

import pytest

from megatron_pipette.cost.memory import DEFAULT_FRAGMENTATION
from megatron_pipette.spec.hardware import lookup_gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "device"))
import cost_check  # noqa: E402


@pytest.mark.parametrize("name", ["H100-80GB", "H200"])
def test_the_planner_prices_every_shape_and_the_training_step(name):
    gpu = lookup_gpu(name)
    shapes = [(m, n, k, 1) for m, n, k in cost_check.SKINNY] + [
        (rows, n, k, e) for h, f in cost_check.MOE_SHAPES for e in cost_check.EXPERTS for rows in cost_check.ROWS
        for n, k in ((2 * f, h), (h, f))]
    for m, n, k, count in shapes:
        for dtype in ("bf16", "fp8"):
            for price in (cost_check.planner_gemm_s, cost_check.roofline_s):
                assert 0 < price(gpu, dtype, m, n, k, count) < math.inf
    estimate = cost_check.estimate(gpu, cost_check.train_flags(False, 13))
    assert "error" not in estimate, estimate
    stage = estimate["memory"]["stages"][0]
    assert 0 < estimate["iteration_time_s"] < math.inf and estimate["memory"]["fits"]
    assert 1.2e9 < stage["parameters"] < 1.4e9            # the ~1B model the docs name
    assert 0 < stage["peak_bytes"] - stage["overhead_bytes"] < stage["peak_bytes"]


LOG = """\
 > number of parameters on (tensor, gtp_weight_remat, pipeline) model parallel rank (0, 0, 0): 1278332928
 [2026-11-26 06:59:51.577597] iteration        1/       4 | consumed samples:            8 | elapsed time per iteration (ms): 2783.8 | learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 6.954331E+00 |
Theoretical memory footprints: weight and optimizer=21947.05 MB, activation=7010.20 MB, total=28957.25 MB
[Rank 0] (after 1 iterations) memory (MB) | allocated: 21000.50 | max allocated: 30000.25 | reserved: 31000.00 | max reserved: 32000.00
 [2026-11-26 06:59:51.620791] iteration        2/       4 | consumed samples:           16 | elapsed time per iteration (ms): 413.5 | learning rate: 8.681980E-05 | global batch size:     8 |
 [2026-11-26 06:59:51.662237] iteration        3/       4 | consumed samples:           24 | elapsed time per iteration (ms): 301.4 | learning rate: 5.500000E-05 | global batch size:     8 |
 [2026-11-26 06:59:51.662237] iteration        4/       4 | consumed samples:           32 | elapsed time per iteration (ms): 300.0 | learning rate: 5.500000E-05 | global batch size:     8 |
[Rank 0] (after 4 iterations) memory (MB) | allocated: 21000.50 | max allocated: 30100.00 | reserved: 31000.00 | max reserved: 32500.00
"""  # noqa: E501  (the lines as megatron/training prints them)


def test_reads_megatron_log():
    got = cost_check.parse_megatron_log(LOG, warmup=1)
    assert got["iteration_s"] == pytest.approx([2.7838, 0.4135, 0.3014, 0.3])
    assert got["step_s"] == pytest.approx(statistics.median([0.4135, 0.3014, 0.3]))
    assert got["max_allocated_bytes"] == round(30100.0 * 2**20)      # the last report
    assert got["max_reserved_bytes"] == round(32500.0 * 2**20)
    assert got["parameters"] == 1278332928
    assert got["megatron_theoretical_bytes"] == round(28957.25 * 2**20)
    assert got["allocated_bytes"] == round(21000.50 * 2**20)          # what stays between steps
    assert cost_check.allocator_loss(got) == pytest.approx((32500.0 - 30100.0) / (30100.0 - 21000.50))


KEPT_TRAINING_LOGS = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "results").glob(
    "h200-*/train_megatron.log"))


def test_the_default_fragmentation_is_the_kept_measurement():
    """DEFAULT_FRAGMENTATION is the largest allocator loss the kept GPU training steps measured: it
    moves only with a measurement."""
    losses = [cost_check.allocator_loss(cost_check.parse_megatron_log(log.read_text(), warmup=3))
              for log in KEPT_TRAINING_LOGS]
    assert len(losses) >= 2 and None not in losses
    assert round(max(losses), 3) == DEFAULT_FRAGMENTATION
