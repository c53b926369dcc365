"""The self-check's chart: a PNG of each stage's predicted and measured time and memory."""

import io
import math

import pytest
from matplotlib.image import imread

from megatron_pipette.calibration.check import MemorySample, RankSample, TensorSample, compare
from megatron_pipette.calibration.fit import Factors, Fit
from megatron_pipette.cost.memory import StageMemory
from megatron_pipette.report.check_chart import SIZE_IN, check_bars, check_chart
from megatron_pipette.report.figures import DPI
from megatron_pipette.units import GiB, MiB


def stage(k: int, weights: int, activations: int) -> StageMemory:
    return StageMemory(stage=k, parameters=0, weight_bytes=weights, gradient_bytes=weights, optimizer_bytes=2 * weights,
                       activation_bytes=activations, transient_bytes=activations // 4, overhead_bytes=GiB)


CANDIDATE = (1.5, (stage(0, 4 * GiB, 8 * GiB), stage(1, 3 * GiB, 6 * GiB), stage(2, 3 * GiB, 4 * GiB)))
"""A chosen candidate's predicted seconds per iteration and memory per stage."""
FIT = Fit(factors=Factors(), predicted_s=1.5, calibrated_s=1.7, measured_s=1.7, predicted_passes_s=(1.0, 0.9, 0.8),
          calibrated_passes_s=(1.2, 1.1, 1.0))


def on_gpu(rank: int, k: int, compute_s: float, peak_gib: float) -> RankSample:
    memory = MemorySample(before_step=int(10 * GiB), peak_allocated=int(peak_gib * GiB),
                          peak_reserved=int(peak_gib * GiB), outside_allocator=0)
    return RankSample(rank=rank, stage=k, iteration_s=1.7, forward_backward_s=1.6, compute_s=compute_s, memory=memory)


def test_a_gpu_check_shows_time_and_peak_memory_per_stage():
    """Stage 2 did not report: its measured bars are not drawn (NaN), its predictions are."""
    check = compare(*CANDIDATE, [on_gpu(0, 0, 1.25, 30.0), on_gpu(1, 1, 1.05, 20.0)], (2, 4), missing_ranks=[2])
    png, bars = check_chart(check, FIT)
    assert imread(io.BytesIO(png)).shape[:2] == (SIZE_IN[1] * DPI, SIZE_IN[0] * DPI)
    time = {(b.series, b.stage): b.value for b in bars if b.panel == "time"}
    assert [time["measured", k] for k in (0, 1)] == [1.25, 1.05] and math.isnan(time["measured", 2])
    assert [time["uncalibrated model", k] for k in range(3)] == [1.0, 0.9, 0.8]
    assert [time["calibrated model", k] for k in range(3)] == [1.2, 1.1, 1.0]
    memory = {(b.series, b.stage): b.value for b in bars if b.panel == "memory"}
    assert memory["measured", 0] == pytest.approx(30.0) and math.isnan(memory["measured", 2])
    assert memory["predicted", 2] == pytest.approx(CANDIDATE[1][2].total_bytes / GiB)


def test_a_cpu_check_shows_the_counted_tensors_and_no_fit_only_the_measured_time():
    samples = [RankSample(rank=k, stage=k, iteration_s=1.7, forward_backward_s=1.6, compute_s=1.0, memory=None,
                          tensors=TensorSample(model_state=(40 + k) * MiB, activations=(30 + k) * MiB))
               for k in range(3)]
    bars, unit = check_bars(compare(*CANDIDATE, samples, (2, 4)), None)
    assert unit == "MiB"
    assert {b.series for b in bars if b.panel == "time"} == {"measured"}
    counted = {(b.series, b.stage): b.value for b in bars if b.panel == "memory" and b.series.endswith("counted")}
    assert counted == {("model state counted", k): 40 + k for k in range(3)} | \
        {("activations counted", k): 30 + k for k in range(3)}
    png, _ = check_chart(compare(*CANDIDATE, samples, (2, 4)), None)
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
