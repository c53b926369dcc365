"""Which shapes to measure, in what order, and how to fill in the rest.

Measuring every (part, TP, micro-batch, recompute) combination would take too
long for a large model, so the profiler measures the smallest and largest
micro-batch size of each combination and interpolates the ones between:
compute time and saved activations are affine in the number of tokens. The
order puts the shapes the planner cannot do without first (one layer per TP
size), so a budget cut drops the least useful ones. Everything here is pure:
no torch, no clocks.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import zip_longest

PARTS = ("layer", "embedding", "output_layer")


@dataclass(frozen=True, kw_only=True)
class Shape:
    """One measurement: a part of the model at one per-rank shape."""

    part: str
    """"layer" (one transformer layer), "embedding", or "output_layer" (final norm, logits, loss)."""
    tensor_model_parallel_size: int
    micro_batch_size: int
    recompute_granularity: str | None = None
    context_parallel_size: int = 1
    """A layer over one context-parallel rank's share of the sequence, seq_length / CP tokens."""

    def describe(self) -> dict:
        described = {"part": self.part, "tensor_model_parallel_size": self.tensor_model_parallel_size,
                     "micro_batch_size": self.micro_batch_size, "recompute_granularity": self.recompute_granularity}
        return described | ({"context_parallel_size": self.context_parallel_size}
                            if self.context_parallel_size > 1 else {})


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What one measurement found."""

    shape: Shape
    forward_s: float
    backward_s: float
    activation_bytes: int
    """Bytes of distinct storages autograd kept for backward (parameters and shared inputs excluded)."""
    sequence_sharded_bytes: int = 0
    """The part of activation_bytes that sequence parallelism divides by TP (norms, dropout, linear inputs)."""
    wall_s: float = 0.0
    """Wall time the measurement took (build, warm-up and timed iterations), for the budget."""
    run_s: float = 0.0
    """The part of wall_s spent running forward and backward; the rest is building (and, on the
    first shape, one-time costs such as compiling fused kernels), which does not scale with size."""
    extra: tuple[tuple[str, int], ...] = ()
    """Device-specific cross-checks (GPU allocator deltas), copied into the entry."""


def plan_shapes(tp_sizes: Sequence[int], micro_batch_sizes: Sequence[int],
                recompute: Sequence[str | None], cp_sizes: Sequence[int] = (1,)) -> list[Shape]:
    """The shapes to measure, most useful first.

    Order: a layer at the smallest micro-batch for every TP size; the embedding and
    output layer at the smallest micro-batch; layers at the largest micro-batch; the
    recomputation variants (smallest, then largest micro-batch); the embedding and
    output layer at the largest micro-batch; a layer over each context-parallel shard
    (CP > 1) at the smallest micro-batch; last, the sizes in between (layers, then
    recomputation variants, then embedding and output layer), each interval's middle
    first. What the budget leaves out is interpolated between the nearest measured
    sizes. The middles are measured because time is not linear in the micro-batch: at
    small sizes a layer waits on kernel launches, not on the device (an H200 ran
    gpt3-1.3b's layer at micro-batch 1 in 2.9 ms, at 8 in 8.1 ms: a line through the
    two puts micro-batch 4 at 5.1 ms where the device needs about 4), and a line
    through the ends makes every middle size look slower than it is.
    """
    tps = sorted(set(tp_sizes))
    small, large = min(micro_batch_sizes), max(micro_batch_sizes)
    ends = [small] if small == large else [small, large]
    variants = [r for r in dict.fromkeys(recompute) if r is not None]
    order: list[Shape] = []
    first_layers = [Shape(part="layer", tensor_model_parallel_size=t, micro_batch_size=small)
                    for t in tps] if None in recompute else []
    order += first_layers
    order += [Shape(part=p, tensor_model_parallel_size=t, micro_batch_size=small)
              for t in tps for p in ("embedding", "output_layer")]
    if None in recompute and large != small:
        order += [Shape(part="layer", tensor_model_parallel_size=t, micro_batch_size=large) for t in tps]
    for mbs in ends:
        order += [Shape(part="layer", tensor_model_parallel_size=t, micro_batch_size=mbs, recompute_granularity=r)
                  for r in variants for t in tps]
    if large != small:
        order += [Shape(part=p, tensor_model_parallel_size=t, micro_batch_size=large)
                  for t in tps for p in ("embedding", "output_layer")]
    if None in recompute:
        order += [Shape(part="layer", tensor_model_parallel_size=t, micro_batch_size=small, context_parallel_size=c)
                  for c in sorted(set(cp_sizes) - {1}) for t in tps]
    middles = _middles_first(sorted(set(micro_batch_sizes)))
    for r in dict.fromkeys(recompute):
        order += [Shape(part="layer", tensor_model_parallel_size=t, micro_batch_size=m, recompute_granularity=r)
                  for m in middles for t in tps]
    order += [Shape(part=p, tensor_model_parallel_size=t, micro_batch_size=m)
              for m in middles for t in tps for p in ("embedding", "output_layer")]
    return order


def _middles_first(sizes: list[int]) -> list[int]:
    """The sizes strictly between the first and last, each interval's middle before its halves
    ([1, 2, 4, 8, 16] -> [4, 2, 8]): the budget cuts the least informative."""
    inner = sizes[1:-1]
    if not inner:
        return []
    mid = len(sizes) // 2
    left, right = _middles_first(sizes[:mid + 1]), _middles_first(sizes[mid:])
    return [sizes[mid], *[m for pair in zip_longest(left, right) for m in pair if m is not None]]


def estimate_wall_s(shape: Shape, done: Iterable[Measured]) -> float | None:
    """A guess at how long measuring `shape` takes, from the shapes already measured.

    Scales the running time of the closest measured shape (same part and TP if possible,
    else any layer) by micro-batch size and 1/TP, and adds the median building overhead
    (a median, so one first-shape compilation does not inflate every estimate); None
    when nothing comparable was measured yet.
    """
    done = list(done)
    same_part = [m for m in done if m.shape.part == shape.part] or [m for m in done if m.shape.part == "layer"]
    if not same_part:
        return None

    def closeness(m: Measured) -> tuple[int, int, int, int]:
        return (m.shape.tensor_model_parallel_size != shape.tensor_model_parallel_size,
                m.shape.recompute_granularity != shape.recompute_granularity,
                m.shape.context_parallel_size != shape.context_parallel_size,
                abs(m.shape.micro_batch_size - shape.micro_batch_size))

    ref = min(same_part, key=closeness)
    scale = (shape.micro_batch_size / ref.shape.micro_batch_size
             * ref.shape.tensor_model_parallel_size / shape.tensor_model_parallel_size
             * ref.shape.context_parallel_size / shape.context_parallel_size)
    if shape.recompute_granularity == "full" and ref.shape.recompute_granularity != "full":
        scale *= 1.4  # the backward pass re-runs the forward pass
    overhead = statistics.median(max(m.wall_s - m.run_s, 0.0) for m in done)
    return ref.run_s * scale + overhead


@dataclass(frozen=True)
class _Point:
    forward_s: float
    backward_s: float
    activation_bytes: float


def _interpolate(points: dict[int, _Point], mbs: int) -> _Point:
    """Linear in micro-batch size between (or beyond) the two nearest measured sizes;
    proportional when only one was measured or a line would go non-positive."""
    if mbs in points:
        return points[mbs]
    sizes = sorted(points, key=lambda m: (abs(m - mbs), m))
    near = sizes[0]
    proportional = _Point(*(v * mbs / near for v in vars(points[near]).values()))
    if len(sizes) == 1:
        return proportional
    below = [m for m in points if m < mbs]
    above = [m for m in points if m > mbs]
    a, b = (max(below), min(above)) if below and above else tuple(sorted(sizes[:2]))
    w = (mbs - a) / (b - a)
    line = _Point(*(va + w * (vb - va) for va, vb in zip(vars(points[a]).values(), vars(points[b]).values())))
    return line if min(vars(line).values()) > 0 else proportional


def layer_entries(results: Iterable[Measured], *, tp_sizes: Sequence[int], micro_batch_sizes: Sequence[int],
                  recompute: Sequence[str | None], sequence_parallel: Sequence[bool],
                  seq_length: int) -> list[dict]:
    """Schema "layers" entries for every requested combination that has a measurement.

    A sequence-parallel entry comes from the same measurement as its non-SP twin:
    the same compute time (norm and dropout on s/TP tokens are not re-timed) and the
    sequence-sharded activations divided by TP. SP needs TP > 1 and the rank's tokens
    (seq_length / CP) divisible by TP, as in Megatron; other SP combinations are left out.
    A context-parallel shard's entries carry "context_parallel_size".
    """
    by_key: dict[tuple[int, str | None, int], dict[int, Measured]] = {}
    for m in results:
        if m.shape.part == "layer":
            by_key.setdefault((m.shape.tensor_model_parallel_size, m.shape.recompute_granularity,
                               m.shape.context_parallel_size), {})[m.shape.micro_batch_size] = m
    rows = []
    keys = [(tp, rc, cp) for cp in sorted({k[2] for k in by_key}) for tp in sorted(set(tp_sizes))
            for rc in dict.fromkeys(recompute) if (tp, rc, cp) in by_key]
    for tp, rc, cp in keys:
        measured = by_key[tp, rc, cp]
        for sp in dict.fromkeys(sequence_parallel):
            if sp and (tp == 1 or seq_length // cp % tp):
                continue
            points = {mbs: _Point(m.forward_s, m.backward_s, _sp_bytes(m, tp) if sp else m.activation_bytes)
                      for mbs, m in measured.items()}
            for mbs in sorted(set(micro_batch_sizes)):
                p = _interpolate(points, mbs)
                # SP entries are derived from the non-SP run (its times, the SP-sharded bytes): not measured.
                row = {"tensor_model_parallel_size": tp, "micro_batch_size": mbs, "sequence_parallel": sp,
                       "recompute_granularity": rc, **_values(p), "measured": mbs in measured and not sp}
                if cp > 1:
                    row["context_parallel_size"] = cp
                if mbs in measured and not sp:
                    row.update(dict(measured[mbs].extra))
                rows.append(row)
    return rows


def part_entries(results: Iterable[Measured], part: str, *, tp_sizes: Sequence[int],
                 micro_batch_sizes: Sequence[int]) -> list[dict]:
    """Schema "embedding" / "output_layer" entries (no SP or recompute variants)."""
    by_tp: dict[int, dict[int, Measured]] = {}
    for m in results:
        if m.shape.part == part:
            by_tp.setdefault(m.shape.tensor_model_parallel_size, {})[m.shape.micro_batch_size] = m
    rows = []
    for tp in sorted(set(tp_sizes)):
        measured = by_tp.get(tp)
        if not measured:
            continue
        points = {mbs: _Point(m.forward_s, m.backward_s, m.activation_bytes) for mbs, m in measured.items()}
        for mbs in sorted(set(micro_batch_sizes)):
            row = {"tensor_model_parallel_size": tp, "micro_batch_size": mbs,
                   **_values(_interpolate(points, mbs)), "measured": mbs in measured}
            if mbs in measured:
                row.update(dict(measured[mbs].extra))
            rows.append(row)
    return rows


def _sp_bytes(m: Measured, tp: int) -> float:
    return m.activation_bytes - m.sequence_sharded_bytes + m.sequence_sharded_bytes / tp


def _values(p: _Point) -> dict:
    return {"forward_s": p.forward_s, "backward_s": p.backward_s, "activation_bytes": int(round(p.activation_bytes))}
