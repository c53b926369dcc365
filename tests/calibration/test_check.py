"""The self-check's comparison and its log lines (torch-free)."""

import json

from megatron_pipette.calibration.check import (
    GiB,
    MemorySample,
    MiB,
    RankSample,
    TensorSample,
    compare,
    gib,
    sample_from_json,
)
from megatron_pipette.cost.memory import StageMemory


def stage_memory(stage: int, weights: float, activations: float, overheads: float) -> StageMemory:
    """A stage's predicted memory, in GiB; weights, gradients and optimizer state split 1:1:2."""
    b = lambda x: int(x * GiB)  # noqa: E731
    return StageMemory(stage=stage, parameters=0, weight_bytes=b(weights / 4), gradient_bytes=b(weights / 4),
                       optimizer_bytes=b(weights / 2), activation_bytes=b(activations * 0.75),
                       transient_bytes=b(activations * 0.25), overhead_bytes=b(overheads))


CANDIDATE = (1.82, (stage_memory(0, 30.0, 25.0, 6.2), stage_memory(1, 28.0, 24.0, 6.0)))
"""A chosen candidate's predicted seconds per iteration and memory per stage."""


def sample(rank: int, stage: int, seconds: float, memory: MemorySample | None = None) -> RankSample:
    return RankSample(rank=rank, stage=stage, iteration_s=seconds, forward_backward_s=seconds * 0.9,
                      compute_s=seconds * 0.6, memory=memory)


def gpu(state: float, activations: float, slack: float, outside: float) -> MemorySample:
    """Measured memory in GiB: model state, activations above it, reserved-but-free, non-allocator."""
    peak = state + activations
    return MemorySample(before_step=int(state * GiB), peak_allocated=int(peak * GiB),
                        peak_reserved=int((peak + slack) * GiB), outside_allocator=int(outside * GiB))


def test_time_line_reads_as_the_issue_asks() -> None:
    result = compare(*CANDIDATE, [sample(r, r // 2, 1.95) for r in range(4)], (2, 6))
    assert result.lines()[0] == "self-check, iterations 2-6: predicted 1.82 s/iteration, measured 1.95 s (+7.1%)"
    assert result.measured_s == 1.95 and abs(result.forward_backward_s - 1.755) < 1e-12


def test_measured_time_is_the_median_over_ranks() -> None:
    result = compare(*CANDIDATE, [sample(0, 0, 1.0), sample(1, 0, 2.0), sample(2, 1, 9.0)], (2, 6))
    assert result.measured_s == 2.0


def test_without_memory_figures_memory_is_not_measured() -> None:
    lines = compare(*CANDIDATE, [sample(0, 0, 1.9), sample(1, 1, 1.9)], (2, 6)).lines()
    assert lines[1] == "self-check: peak memory per stage predicted 61.2/58.0 GiB, not measured on CPU"
    assert len(lines) == 2


def test_counted_tensors_are_set_against_model_state_and_activations() -> None:
    """CPU rehearsal: per stage, the largest count of each term over the stage's ranks against the
    plan's weights + gradients + optimizer state and its activations (not the transient bytes, which
    live inside one pass, nor overheads: a tensor count sees neither). Kept through JSON."""
    counted = [TensorSample(model_state=int(29.5 * GiB), activations=int(18.0 * GiB)),
               TensorSample(model_state=int(30.5 * GiB), activations=int(17.5 * GiB)),
               TensorSample(model_state=int(28.0 * GiB), activations=int(19.0 * GiB))]
    samples = [sample_from_json(json.loads(json.dumps(RankSample(
        rank=r, stage=r // 2, iteration_s=1.9, forward_backward_s=1.7, compute_s=1.1, memory=None,
        tensors=t).as_json()))) for r, t in enumerate(counted)]
    result = compare(*CANDIDATE, samples, (2, 6))
    stage0, stage1 = result.stages
    assert stage0.measured_tensors == {"model state": int(30.5 * GiB), "activations": int(18.0 * GiB)}
    assert stage1.predicted_tensors == {"model state": int(28.0 * GiB), "activations": int(24.0 * 0.75 * GiB)}
    assert result.lines()[1] == (
        "self-check: peak memory per stage predicted 61.2/58.0 GiB; on CPU, tensors counted per stage: "
        "model state predicted 30720/28672, counted 31232/28672 MiB; activations predicted 19200/18432, "
        "counted 18432/19456 MiB")
    assert result.over_memory() == [] and int(30.5 * GiB) / MiB == 31232


def test_memory_within_the_margin_is_no_warning() -> None:
    samples = [sample(0, 0, 1.9, gpu(29.0, 24.0, 1.0, 5.8)), sample(1, 1, 1.9, gpu(28.5, 23.0, 0.8, 4.8))]
    result = compare(*CANDIDATE, samples, (2, 6))
    assert result.lines()[1] == "self-check: peak memory per stage predicted 61.2/58.0 GiB, measured 59.8/57.1 GiB"
    assert result.over_memory() == [] and len(result.lines()) == 2


def test_a_stage_over_its_prediction_names_the_term() -> None:
    """Stage 1's activations take 8 GiB more than predicted: the warning says activations, and
    the worst of the stage's ranks is the one compared."""
    samples = [sample(0, 0, 1.9, gpu(29.0, 24.0, 1.0, 5.8)), sample(1, 1, 1.9, gpu(28.0, 24.0, 0.5, 5.5)),
               sample(2, 1, 1.9, gpu(28.0, 32.0, 0.5, 5.5))]
    result = compare(*CANDIDATE, samples, (2, 6))
    (stage, term), = result.over_memory()
    assert (stage.stage, term) == (1, "activations")
    assert stage.measured_peak_bytes == samples[2].memory.peak_bytes
    warning = result.lines()[2]
    assert warning.startswith("self-check: WARNING: stage 1 peaked at 66.00 GiB, 13.8% over its prediction "
                              "(margin 5%); activations took 32.00 GiB against 24.00 predicted"), warning


def test_overheads_outside_the_allocator_are_their_own_term() -> None:
    samples = [sample(0, 0, 1.9, gpu(29.0, 24.0, 0.5, 12.0)), sample(1, 1, 1.9, gpu(28.0, 23.0, 0.5, 5.0))]
    (stage, term), = compare(*CANDIDATE, samples, (2, 6)).over_memory()
    assert (stage.stage, term) == (0, "overheads")


def test_ranks_that_did_not_report_are_named() -> None:
    result = compare(*CANDIDATE, [sample(0, 0, 1.9, gpu(29.0, 24.0, 1.0, 5.8))], (2, 6), missing_ranks=[1, 3])
    lines = result.lines()
    assert lines[1] == "self-check: peak memory per stage predicted 61.2/58.0 GiB, measured 59.8/? GiB"
    assert lines[-1] == "self-check: rank(s) 1, 3 did not report; compared without them"
    assert result.stages[1].ranks == 0


def test_samples_travel_as_json() -> None:
    for s in (sample(3, 1, 0.5), sample(2, 0, 0.25, gpu(1.0, 2.0, 0.1, 0.6))):
        assert sample_from_json(json.loads(json.dumps(s.as_json()))) == s


def test_gib_keeps_three_digits_of_the_largest() -> None:
    assert gib([int(61.23 * GiB), int(58 * GiB)]) == "61.2/58.0"
    assert gib([int(1.512 * GiB), int(0.2 * GiB)]) == "1.51/0.20"
    assert gib([12 << 20]) == "0.012"
