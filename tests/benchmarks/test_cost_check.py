"""benchmarks/validation/cost_check.py, the GPU check: the planner prices every shape it times and the
training step it runs (given the very flags Megatron gets), and it reads Megatron's log as
Megatron writes it. Runs on CPU; the measurements themselves need the GPU."""

import itertools
import json
import math
import statistics
from pathlib import Path

import pytest

from benchmarks.validation import cost_check
from megatron_pipette.cost.execution import DEFAULT_EXECUTION
from megatron_pipette.cost.memory import DEFAULT_FRAGMENTATION
from megatron_pipette.spec.hardware import lookup_gpu


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


def test_a_line_splits_a_per_micro_batch_cost_from_a_per_token_one():
    tokens = [2048, 4096, 8192, 16384]
    got = cost_check.split_fixed(tokens, [1.5e-3 + 2e-9 * t for t in tokens])
    assert got["fixed_s"] == pytest.approx(1.5e-3, rel=1e-3) and got["per_token_s"] == pytest.approx(2e-9, rel=1e-3)
    assert cost_check.split_fixed([4096], [1e-3]) is None


@pytest.mark.parametrize("hidden, ffn", cost_check.MOE_LAYER_SHAPES)
def test_the_moe_layer_price_is_mostly_per_token(hidden, ffn):
    """The planner's price of the layer's kernels grows with the tokens; its own per-micro-batch part
    (the experts' weights read once a micro-batch, GEMMs more efficient when larger) is positive and
    well under the fixed cost fitted beside it (Execution.moe_layer_fixed_s), which the GPU part
    measures apart."""
    gpu = lookup_gpu("H100-80GB")
    prices = [cost_check.moe_layer_price(gpu, hidden, ffn, 16, 8, t) for t in cost_check.MOE_LAYER_TOKENS]
    forward, backward = zip(*prices, strict=True)
    assert all(a < b for a, b in zip(forward, forward[1:])) and all(b > f for f, b in prices)
    line = cost_check.split_fixed(list(cost_check.MOE_LAYER_TOKENS), list(forward))
    assert 0 < line["fixed_s"] < DEFAULT_EXECUTION.moe_layer_fixed_s / 4


def test_the_moe_part_dry_run_prices_every_point(tmp_path):
    """On a CPU (no CUDA for megatron-core's router) the part prices the shapes and measures none."""
    out = tmp_path / "moe.json"
    assert cost_check.main(["moe", "--dry-run", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    quick = cost_check.QUICK["moe_layer"]
    assert [r["dispatch"] for r in doc["rows"]] == list(cost_check.MOE_LAYER_DISPATCH) * (
        len(quick["shapes"]) * len(quick["experts"]))
    assert [len(r["points"]) for r in doc["rows"]] == [len(quick["tokens"])] * len(doc["rows"])
    assert all(r["priced_kernels"]["forward"]["per_token_s"] > 0 and r["measured"]["forward"] is None
               for r in doc["rows"])
    assert doc["moe_layer_fixed_s"] > 0 and cost_check.moe_lines(doc)[0].startswith("moe layer")


@pytest.mark.megatron
@pytest.mark.parametrize("dispatch", cost_check.MOE_LAYER_DISPATCH)
def test_megatron_accepts_each_timed_moe_layer(dispatch):
    """The GPU's time is scarce: megatron-core's TransformerConfig takes both dispatches' layers here,
    and only the padded one drops and pads to capacity."""
    padded = dispatch == "drop-and-pad"
    for (hidden, ffn), experts in itertools.product(cost_check.MOE_LAYER_SHAPES, cost_check.MOE_LAYER_EXPERTS):
        config = cost_check.moe_layer_config(hidden, ffn, experts, cost_check.MOE_LAYER_TOPK, padded)
        assert config.moe_pad_expert_input_to_capacity is padded
        assert config.moe_expert_capacity_factor == (1.0 if padded else None)


def test_padding_to_capacity_prices_the_same_kernels():
    """At capacity factor 1.0 a padded layer's experts get the rows a balanced dropless one does, so
    its kernels are priced alike: what the GPU part finds between the two is the host wait."""
    gpu = lookup_gpu("H100-80GB")
    for t in cost_check.MOE_LAYER_TOKENS:
        assert cost_check.moe_layer_price(gpu, 2048, 768, 16, 8, t, padded=True) == pytest.approx(
            cost_check.moe_layer_price(gpu, 2048, 768, 16, 8, t))
