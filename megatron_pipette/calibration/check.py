"""The self-check's verdict: the plan's predictions against what every rank measured.

Each rank reports the median of its iteration times and of its forward+backward time per
iteration over the checked iterations, and on a GPU its memory: allocated at a step's start
(model state: weights, gradients, optimizer state), the peak allocated and reserved, and the
device memory held outside PyTorch's allocator (CUDA context, NCCL buffers). Those split the
measured peak into the three terms the memory model predicts separately, so a stage over its
prediction can be told which term is wrong. In CPU rehearsal, where there is no allocator to ask,
each rank counts tensors instead (TensorSample): the model state alive between steps and the
activations autograd holds for backward at once, the two terms that do not depend on an allocator.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from megatron_pipette.cost.memory import StageMemory
from megatron_pipette.units import GiB, MiB

MEMORY_MARGIN = 0.05
"""A stage's measured peak may exceed its prediction by this fraction before it is a warning:
allocator rounding and the few iterations measured move the peak by a few percent."""
MEMORY_TERMS = ("model state", "activations", "overheads")
TENSOR_TERMS = ("model state", "activations")


@dataclass(frozen=True, kw_only=True)
class MemorySample:
    """One rank's device memory over the checked iterations, bytes."""

    before_step: int
    """Allocated at the start of a step (the least seen): weights, gradients, optimizer state."""
    peak_allocated: int
    peak_reserved: int
    outside_allocator: int
    """Device memory in use beyond what the caching allocator reserved: CUDA context, NCCL."""

    @property
    def terms(self) -> dict[str, int]:
        """The measured peak split as the memory model splits its prediction."""
        return {"model state": self.before_step,
                "activations": self.peak_allocated - self.before_step,
                "overheads": self.peak_reserved - self.peak_allocated + self.outside_allocator}

    @property
    def peak_bytes(self) -> int:
        return self.peak_reserved + self.outside_allocator


@dataclass(frozen=True, kw_only=True)
class TensorSample:
    """One rank's tensors in CPU rehearsal, bytes of distinct storages."""

    model_state: int
    """Alive between steps, after the optimizer has made its state: weights, gradient buffers,
    optimizer state (and a few small buffers: position tables, RNG states)."""
    activations: int
    """The most that forward passes held for backward at once over one step (saved tensors,
    storages alive before the step left out)."""

    @property
    def terms(self) -> dict[str, int]:
        return {"model state": self.model_state, "activations": self.activations}


@dataclass(frozen=True, kw_only=True)
class RankSample:
    """What one rank measured over the checked iterations."""

    rank: int
    stage: int
    """Pipeline rank."""
    iteration_s: float
    """Median wall time of one training step."""
    forward_backward_s: float
    """Median time in the schedule (forward_backward_func): the step without the optimizer."""
    compute_s: float
    """Median per step of the time spent in forward and backward passes (tensor-parallel
    collectives inside them included), the part the layer profile and the GEMM rate price."""
    memory: MemorySample | None
    """Device memory (None in CPU rehearsal, where there is no allocator)."""
    tensors: TensorSample | None = None
    """Counted tensors (CPU rehearsal only)."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def sample_from_json(doc: Mapping[str, Any]) -> RankSample:
    memory, tensors = doc.get("memory"), doc.get("tensors")
    return RankSample(rank=int(doc["rank"]), stage=int(doc["stage"]), iteration_s=float(doc["iteration_s"]),
                      forward_backward_s=float(doc["forward_backward_s"]), compute_s=float(doc["compute_s"]),
                      memory=None if memory is None else MemorySample(**{k: int(v) for k, v in memory.items()}),
                      tensors=None if tensors is None else TensorSample(**{k: int(v) for k, v in tensors.items()}))


@dataclass(frozen=True, kw_only=True)
class StageCheck:
    """One pipeline stage: its ranks' figures against the plan's."""

    stage: int
    ranks: int
    """Ranks of this stage that reported."""
    compute_s: float
    """Median over those ranks of their forward+backward time per iteration."""
    predicted_peak_bytes: int
    predicted_terms: dict[str, int]
    measured_peak_bytes: int | None
    """The worst reporting rank's peak (None: not measured)."""
    measured_terms: dict[str, int] | None
    """That rank's peak split into MEMORY_TERMS."""
    predicted_tensors: dict[str, int]
    """The plan's model state and activations (TensorSample.terms' names)."""
    measured_tensors: dict[str, int] | None
    """Each term's largest count over the stage's ranks (None: not counted; on a GPU)."""


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    iterations: tuple[int, int]
    """First and last checked iteration, counted from 1 at the job's first step."""
    predicted_s: float
    measured_s: float
    """Median over ranks of each rank's median iteration time."""
    forward_backward_s: float
    """The same of the time in the schedule; the rest of a step is mostly the optimizer's."""
    stages: tuple[StageCheck, ...]
    missing_ranks: tuple[int, ...]
    """Ranks that did not report in time (their stages are compared without them)."""
    margin: float = MEMORY_MARGIN

    @property
    def time_error(self) -> float:
        """Measured over predicted, minus one: +0.071 is 7.1% slower than predicted."""
        return self.measured_s / self.predicted_s - 1

    def over_memory(self) -> list[tuple[StageCheck, str]]:
        """Stages whose measured peak exceeds the prediction by more than the margin, each with the
        term that exceeds its own prediction most."""
        out = []
        for s in self.stages:
            if s.measured_peak_bytes is not None and s.measured_peak_bytes > s.predicted_peak_bytes * (1 + self.margin):
                term = max(MEMORY_TERMS, key=lambda t: s.measured_terms[t] - s.predicted_terms[t])
                out.append((s, term))
        return out

    def lines(self) -> list[str]:
        """The log: one line for time, one for memory, one warning per stage over its prediction."""
        first, last = self.iterations
        out = [f"self-check, iterations {first}-{last}: predicted {self.predicted_s:.3g} s/iteration, "
               f"measured {self.measured_s:.3g} s ({self.time_error:+.1%})"]
        predicted = [s.predicted_peak_bytes for s in self.stages]
        measured = [s.measured_peak_bytes for s in self.stages]
        head = f"self-check: peak memory per stage predicted {gib(predicted)} GiB"
        if any(m is not None for m in measured):
            out.append(f"{head}, measured {gib(measured)} GiB")
        elif any(s.measured_tensors is not None for s in self.stages):
            out.append(f"{head}; on CPU, tensors counted per stage: " + "; ".join(
                f"{term} predicted {gib([s.predicted_tensors[term] for s in self.stages], MiB)}, counted "
                f"{gib([None if s.measured_tensors is None else s.measured_tensors[term] for s in self.stages], MiB)}"
                " MiB" for term in TENSOR_TERMS))
        else:
            out.append(f"{head}, not measured on CPU")
        for s, term in self.over_memory():
            over = s.measured_peak_bytes / s.predicted_peak_bytes - 1
            out.append(f"self-check: WARNING: stage {s.stage} peaked at {s.measured_peak_bytes / GiB:.2f} GiB, "
                       f"{over:.1%} over its prediction (margin {self.margin:.0%}); {term} took "
                       f"{s.measured_terms[term] / GiB:.2f} GiB against {s.predicted_terms[term] / GiB:.2f} predicted")
        if self.missing_ranks:
            out.append(f"self-check: rank(s) {', '.join(map(str, self.missing_ranks))} did not report; "
                       "compared without them")
        return out


def gib(values: Sequence[int | None], unit: int = GiB) -> str:
    """Byte counts in GiB (or `unit`) joined by '/', all with the decimals that give the largest
    three digits ('?' for a stage none of whose ranks reported)."""
    top = max((v for v in values if v is not None), default=0) / unit
    decimals = min(3, max(0, 2 - math.floor(math.log10(top)))) if top > 0 else 1
    return "/".join("?" if v is None else f"{v / unit:.{decimals}f}" for v in values)


def predicted_terms(stage: StageMemory) -> dict[str, int]:
    """A stage's predicted memory in MEMORY_TERMS."""
    return {"model state": stage.weight_bytes + stage.gradient_bytes + stage.optimizer_bytes,
            "activations": stage.activation_bytes + stage.transient_bytes,
            "overheads": stage.overhead_bytes}


def predicted_tensors(stage: StageMemory) -> dict[str, int]:
    """A stage's predicted memory in TensorSample's terms (no transient or overhead bytes: a
    tensor count sees neither the allocator nor what lives only inside one pass)."""
    return {"model state": predicted_terms(stage)["model state"], "activations": stage.activation_bytes}


def compare(predicted_s: float, memory: Sequence[StageMemory], samples: Sequence[RankSample],
            iterations: tuple[int, int], missing_ranks: Sequence[int] = (),
            margin: float = MEMORY_MARGIN) -> CheckResult:
    """Hold the plan's chosen candidate (its predicted iteration time and stage memory) against the samples."""
    assert samples, "at least rank 0 reports"
    stages = []
    for planned in memory:
        mine = [s for s in samples if s.stage == planned.stage]
        worst = max((s.memory for s in mine if s.memory is not None), key=lambda m: m.peak_bytes, default=None)
        counted = [s.tensors.terms for s in mine if s.tensors is not None]
        stages.append(StageCheck(
            stage=planned.stage, ranks=len(mine),
            compute_s=statistics.median(s.compute_s for s in mine) if mine else math.nan,
            predicted_peak_bytes=planned.total_bytes, predicted_terms=predicted_terms(planned),
            measured_peak_bytes=None if worst is None else worst.peak_bytes,
            measured_terms=None if worst is None else worst.terms, predicted_tensors=predicted_tensors(planned),
            measured_tensors={t: max(c[t] for c in counted) for t in TENSOR_TERMS} if counted else None))
    return CheckResult(iterations=iterations, predicted_s=predicted_s,
                       measured_s=statistics.median(s.iteration_s for s in samples),
                       forward_backward_s=statistics.median(s.forward_backward_s for s in samples),
                       stages=tuple(stages), missing_ranks=tuple(missing_ranks), margin=margin)
