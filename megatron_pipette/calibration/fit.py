"""Calibration: the cost model's free factors fitted to one self-check, for the next plan on the
same allocation.

A check measures, per rank, the whole step, the schedule inside it (forward_backward_func: the
step without the optimizer) and the forward and backward passes inside that. Each factor is
fitted to the part that identifies it:

* memory-bound rate, from the step minus the schedule: the optimizer step, which the model prices
  at the device's memory bandwidth (not fitted when the distributed optimizer gathers parameters
  inside that step, which is communication);
* compute rate, from the passes of each stage against the model's forward and backward times
  (layer profile and GEMM rate; the tensor-parallel collectives inside them at the link rates
  below). One layout exercises one GEMM shape class (its TP and micro-batch size), so the factor
  applies to every shape alike: scaling only the measured shapes would favour or penalise a
  layout for having been measured;
* link bandwidth, from the schedule as a whole, jointly with the compute rate: what is left
  besides the passes is pipeline exchanges and bubbles and the exposed gradient reduction, priced
  at the links of the kinds the layout used (intra-node, inter-node; one factor for both when a
  layout on several nodes used both). Left as probed when no link rate in range reproduces the
  schedule, or when reproducing it would take a compute rate out of range: the time is then not
  the links', and the residual stays in the calibrated prediction, visible at the next check;
* memory overhead: on a GPU, the worst stage's measured peak minus the model's, added to every
  device's runtime overheads.

Factors scale the probed cluster file and the measured layer profile, the inputs; the cost model
itself is unchanged. They are always relative to those files, never to an earlier calibration.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from megatron_pipette.calibration.check import CheckResult
from megatron_pipette.cost.compute import profiled_rate
from megatron_pipette.cost.memory import DEFAULT_OVERHEADS, RuntimeOverheads
from megatron_pipette.cost.model import CostModel
from megatron_pipette.cost.timing import TimeEstimate
from megatron_pipette.plan.placement import Placement
from megatron_pipette.spec.hardware import Cluster, LinkLevel
from megatron_pipette.spec.job import Job, resolve_job
from megatron_pipette.spec.layer_profile import LayerProfile
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import Workload
from megatron_pipette.units import GiB

LINK_KINDS = ("intra_node", "inter_node")
FACTOR_RANGE = 1000.0
"""Factors are searched within [1/1000, 1000] of the probed figures. Wide, because on CPU a tiny
model's optimizer step is mostly Python (a few hundred times its memory traffic); beyond it the
measurement says the model is missing a term, not that a rate is off."""
MIN_COMM_SHARE = 0.01
"""When halving or doubling the fitted link rate moves the schedule's time by less than this
share, a timing error of that size would move the factor more than 2x: links are left as probed."""
GRID = 25
BISECTIONS = 30
NEWTON_STEPS = 3


@dataclass(frozen=True, kw_only=True)
class Factors:
    """Multipliers of the probed and profiled figures (1: as measured before the job)."""

    compute_rate: float = 1.0
    """Every device's GEMMs (profiled layers included) run at this multiple of the modelled rate."""
    memory_rate: float = 1.0
    """Memory-bound work (the optimizer step, unprofiled elementwise work) runs at this multiple."""
    link_bandwidth: Mapping[str, float] = field(default_factory=dict)
    """Per link kind (LINK_KINDS): the multiple of the probed bandwidth the links attain."""
    memory_overhead_bytes: int = 0
    """Added to every device's runtime overheads (may be negative)."""

    def describe(self) -> str:
        parts = [f"compute x{self.compute_rate:.3g}", f"memory-bound work x{self.memory_rate:.3g}"]
        parts += [f"{kind.replace('_', '-')} links x{k:.3g}" for kind, k in self.link_bandwidth.items()]
        if self.memory_overhead_bytes:
            parts.append(f"memory overhead {self.memory_overhead_bytes / GiB:+.2f} GiB per device")
        return ", ".join(parts) + " of the modelled rates"


def _times(a: np.ndarray, k: float) -> np.ndarray:
    """`a` * k, keeping a uniform level's broadcast view a view (no n x n array at any scale)."""
    if a.ndim == 2 and a.strides == (0, 0):
        return np.broadcast_to(a.flat[0] * k, a.shape)
    return a * k


def _level(level: LinkLevel, k: float) -> LinkLevel:
    exchange = level.exchange_bandwidth_Bps
    return replace(level, bandwidth_Bps=_times(level.bandwidth_Bps, k),
                   exchange_bandwidth_Bps=None if exchange is None else _times(exchange, k))


def calibrated(cluster: Cluster, profile: LayerProfile | None, factors: Factors,
               overheads: RuntimeOverheads = DEFAULT_OVERHEADS) -> CostModel:
    """The cost model of the probed `cluster` and measured `profile` with `factors` applied."""
    links = factors.link_bandwidth
    if profile is not None:
        # Profiled layers run at (profiled time x profiled rate) / device rate: pin the profiled
        # rate so that scaling the device rates scales them too.
        profile = replace(profile, gemm_flops=profiled_rate(profile, cluster))
    scaled = replace(
        cluster, gemm_flops=cluster.gemm_flops * factors.compute_rate,
        memory_bandwidth_Bps=cluster.memory_bandwidth_Bps * factors.memory_rate,
        intra_node=tuple(_level(level, links.get("intra_node", 1.0)) for level in cluster.intra_node),
        inter_node=_level(cluster.inter_node, links.get("inter_node", 1.0)))
    context = max(0, overheads.cuda_context_bytes + factors.memory_overhead_bytes)
    return CostModel(scaled, profile=profile, overheads=replace(overheads, cuda_context_bytes=context))


@dataclass(frozen=True, kw_only=True)
class Fit:
    factors: Factors
    predicted_s: float
    """The measured layout's time under the uncalibrated model."""
    calibrated_s: float
    """Its time under the calibrated model."""
    measured_s: float
    predicted_passes_s: tuple[float, ...] = ()
    """Each stage's forward and backward passes per iteration under the uncalibrated model (the
    passes the check measured per stage)."""
    calibrated_passes_s: tuple[float, ...] = ()
    """The same under the calibrated model."""
    notes: tuple[str, ...] = ()
    """What could not be fitted, and why."""

    def line(self) -> str:
        notes = "".join(f"; {n}" for n in self.notes)
        return (f"calibration: {self.factors.describe()}; this layout predicted {self.calibrated_s:.3g} s "
                f"calibrated, {self.predicted_s:.3g} s before, measured {self.measured_s:.3g} s{notes}")


def link_kinds(cluster: Cluster, layout: Layout) -> tuple[str, ...]:
    """The kinds of link a layout's groups use (none when it has no group of two)."""
    if layout.tp * layout.pp * layout.dp == 1:
        return ()
    return tuple(kind for kind, used in zip(LINK_KINDS, (cluster.gpus_per_node > 1, cluster.num_nodes > 1)) if used)


def _fb_and_passes(model: CostModel, job: Job, placement: Placement) -> tuple[float, np.ndarray, TimeEstimate]:
    """The schedule's time (the iteration without the optimizer), each stage's forward+backward
    seconds per iteration, and the estimate they come from."""
    est = model.time(job, placement.logical_to_physical)
    return est.iteration_time_s - est.breakdown.optimizer_s, _passes(est, job), est


def _passes(est: TimeEstimate, job: Job) -> np.ndarray:
    """Each stage's forward+backward seconds per iteration in an estimate of `job`."""
    return np.array([s.forward_s + s.backward_s for s in est.stage_times]) * job.num_microbatches


def _clip(x: float) -> float:
    return float(np.clip(x, 1 / FACTOR_RANGE, FACTOR_RANGE))


def fit(workload: Workload, cluster: Cluster, profile: LayerProfile | None, layout: Layout, placement: Placement,
        check: CheckResult) -> Fit:
    """Factors that make the model reproduce `check`, the self-check of `layout` under `placement`."""
    job = resolve_job(workload, layout)
    measured = np.array([s.compute_s for s in check.stages])
    seen = np.isfinite(measured)
    kinds = link_kinds(cluster, layout)
    notes = []

    def model(rate: float = 1.0, memory: float = 1.0, link: float = 1.0) -> CostModel:
        return calibrated(cluster, profile, Factors(compute_rate=rate, memory_rate=memory,
                                                    link_bandwidth={k: link for k in kinds}))

    raw = _fb_and_passes(model(), job, placement)[2]
    optimizer_s = check.measured_s - check.forward_backward_s
    memory = 1.0
    if layout.use_distributed_optimizer and layout.dp > 1 and not layout.overlap_param_gather:
        notes.append("the optimizer step gathers parameters: memory-bound rate left as modelled")
    elif optimizer_s > 0:
        memory = raw.breakdown.optimizer_s / optimizer_s
        if _clip(memory) != memory:
            notes.append(f"the optimizer step is out of range for its memory traffic: memory-bound rate held at "
                         f"x{_clip(memory):.3g}")
            memory = _clip(memory)
    def rate_for(link: float) -> float:
        """The compute rate whose passes match the measured ones (least squares over the stages,
        Gauss-Newton in 1 / rate: the passes are piecewise linear in it, the worst replica of a
        stage changing with the rate)."""
        def passes(inverse: float) -> np.ndarray:
            return _fb_and_passes(model(1 / inverse, memory, link), job, placement)[1][seen]

        inverse = 1.0
        for _ in range(NEWTON_STEPS):
            now = passes(inverse)
            slope = (passes(2 * inverse) - now) / inverse
            step = float(slope @ (measured[seen] - now) / (slope @ slope))
            inverse = max(inverse + step, 1 / (2 * FACTOR_RANGE))
        return 1 / inverse

    def error(u: float) -> float:
        link = math.exp(u)
        return _fb_and_passes(model(_clip(rate_for(link)), memory, link), job, placement)[0] - check.forward_backward_s

    link = None
    if kinds:
        link = _root(error, -math.log(FACTOR_RANGE), math.log(FACTOR_RANGE), notes)
        if link is not None and \
                error(math.log(link / 2)) - error(math.log(link * 2)) < MIN_COMM_SHARE * check.forward_backward_s:
            notes.append(f"halving or doubling the link rates moves this layout's schedule by under "
                         f"{MIN_COMM_SHARE:.0%}: links left as probed")
            link = None
        if link is not None and _clip(rate_for(link)) != rate_for(link):
            notes.append("matching the schedule through the links would put compute out of range: links left as "
                         "probed")
            link = None
    rate = _clip(rate_for(1.0 if link is None else link))
    links = {} if link is None else {k: link for k in kinds}
    overhead = 0
    peaks = [s.measured_peak_bytes for s in check.stages]
    if any(p is not None for p in peaks):
        modelled = model().memory(job).stages
        overhead = max(p - m.total_bytes for p, m in zip(peaks, modelled) if p is not None)
    factors = Factors(compute_rate=rate, memory_rate=memory, link_bandwidth=links, memory_overhead_bytes=overhead)
    after = calibrated(cluster, profile, factors).time(job, placement.logical_to_physical)
    return Fit(factors=factors, predicted_s=raw.iteration_time_s, calibrated_s=after.iteration_time_s,
               measured_s=check.measured_s, predicted_passes_s=tuple(map(float, _passes(raw, job))),
               calibrated_passes_s=tuple(map(float, _passes(after, job))), notes=tuple(notes))


def _root(error, lo: float, hi: float, notes: list[str]) -> float | None:
    """exp of the root of `error` on [lo, hi] nearest 0 (the link factor), or None with a note."""
    grid = np.linspace(lo, hi, GRID)
    values = [error(u) for u in grid]
    brackets = [(grid[i], grid[i + 1]) for i in range(GRID - 1) if values[i] == 0 or values[i] * values[i + 1] < 0]
    if not brackets:
        side = "above" if min(values) > 0 else "below"
        notes.append(f"the measured time is {side} what any link rate within x{FACTOR_RANGE:g} gives: "
                     "links left as probed")
        return None
    a, b = min(brackets, key=lambda ab: min(abs(ab[0]), abs(ab[1])))
    fa = error(a)
    for _ in range(BISECTIONS):
        mid = (a + b) / 2
        fm = error(mid)
        if fa * fm <= 0:
            b = mid
        else:
            a, fa = mid, fm
    return math.exp((a + b) / 2)
