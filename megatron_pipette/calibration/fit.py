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
* memory overhead: on a GPU, the worst stage's measured peak minus the model's (none when it is
  under), added to every device's runtime overheads.

Every factor is searched within physical bounds (COMPUTE_BOUNDS, MEMORY_BOUNDS, LINK_BOUNDS,
MAX_OVERHEAD_SHARE): a fit that ends at one, or that
reproduces the check no better than the uncalibrated model, is not stored (Fit.refusal). A new fit
of an allocation is merged with the one stored (merge), so repeated starts converge.

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
COMPUTE_BOUNDS = (1 / 4, 4.0)
"""The compute rate's physical bounds, which are also its search's (as for every factor: a fit that
ends at one is not stored, Fit.refusal, and a stored calibration outside them is set aside,
document.py). The layer profile and the GEMM rate were measured on these very devices, and training
runs the same kernels; other ranks sharing the host (CPU) or the power and clocks (GPU) slow them and
warm caches speed them, by well under 2x (x0.65-1.6 measured on CPU). Beyond 4x the measurement or a
term of the model is wrong, not the rate."""
MEMORY_BOUNDS = (1 / 500, 4.0)
"""The memory-bound rate's: on a GPU the optimizer step streams its state near the probed copy
bandwidth (x0.3-1); on CPU a tiny model's step is mostly Python, a few hundred times its memory
traffic (x0.02-0.15 measured). Above 4x the model counts traffic the step does not make."""
LINK_BOUNDS = (1 / 20, 4.0)
"""The link bandwidth's: the probe measures every link with all GPUs sending at once, as the job
does; in the job compute competes for the same memory and cores, and the schedule's own waits are
charged to the links (x0.2-0.6 of the probed rate on CPU and on the emulated cluster). A link 20x
slower than probed, or 4x faster, is not the link."""
MAX_OVERHEAD_SHARE = 0.25
"""The memory overhead a calibration adds is between 0 and this share of a device's memory: CUDA
context, NCCL buffers and allocator slack take 1-5 GiB of an 80 GiB GPU. A peak more than a quarter
of the device over the model's says a term of the model is wrong, and charging it to every layout
would leave none fitting. A peak under the model's is not subtracted: the model errs on the side of
room."""
AVERAGED_FITS = 4
"""Repeated self-checks on one allocation are combined, not overwritten (merge): each rate is the
geometric mean of its fits, the newest weighted at least 1/AVERAGED_FITS. One allocation's rates are
one physical figure measured again and again; a fit's error is a ratio (a step a few % slower), so
the mean of the logs halves it over four checks, and a lasting change (a degraded link) still takes
over within a few starts."""
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
    """Added to every device's runtime overheads (0 or more, at most MAX_OVERHEAD_SHARE of a device)."""

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
    return replace(level, **{key: _times(getattr(level, key), k) for key in
                             ("bandwidth_Bps", "exchange_bandwidth_Bps", "batched_exchange_bandwidth_Bps")
                             if getattr(level, key) is not None})


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
    fitted: tuple[str, ...] = ()
    """The factors this check measured (FACTOR_NAMES); the others are as modelled, not measured."""
    at_bound: tuple[str, ...] = ()
    """Factors whose fit ended at a bound of its search (*_BOUNDS, MAX_OVERHEAD_SHARE)."""
    error: float = 0.0
    """The calibrated model's error on the check: the root mean square of the log ratios of its
    iteration time and of each stage's passes to the measured ones."""
    uncalibrated_error: float = 0.0
    """The same for the uncalibrated model."""
    device_memory_bytes: int | None = None
    """The device memory of the cluster fitted on (bounds the memory overhead)."""

    def line(self) -> str:
        notes = "".join(f"; {n}" for n in self.notes)
        return (f"calibration: {self.factors.describe()}; this layout predicted {self.calibrated_s:.3g} s "
                f"calibrated, {self.predicted_s:.3g} s before, measured {self.measured_s:.3g} s{notes}")

    def refusal(self) -> str | None:
        """Why this fit must not be stored (None: it may): a factor at a bound of its search is not a
        rate that was found, and a fit no closer to the check than the uncalibrated model adds nothing."""
        if self.at_bound:
            return (f"{', '.join(n.replace('_', ' ') for n in self.at_bound)} reached the bound of its search "
                    "(the measurement says a term of the model is missing or wrong, not that a rate is off)")
        if not self.error < self.uncalibrated_error:
            return (f"it reproduces the check no better than the uncalibrated model (error {self.error:.1%} against "
                    f"{self.uncalibrated_error:.1%})")
        return None


FACTOR_NAMES = ("compute_rate", "memory_rate", *LINK_KINDS, "memory_overhead_bytes")


def link_kinds(cluster: Cluster, layout: Layout) -> tuple[str, ...]:
    """The kinds of link a layout's groups use (none when it has no group of two)."""
    if layout.tp * layout.pp * layout.dp == 1:
        return ()
    return tuple(kind for kind, used in zip(LINK_KINDS, (cluster.gpus_per_node > 1, cluster.num_nodes > 1)) if used)


@dataclass(frozen=True, kw_only=True)
class _Predicted:
    """What a model predicts of the parts of a check (_predicted)."""

    forward_backward_s: float
    """The schedule's time: the iteration without the optimizer."""
    passes_s: np.ndarray
    """Each stage's forward+backward seconds per iteration."""
    estimate: TimeEstimate
    """The estimate they come from."""


def _predicted(model: CostModel, job: Job, placement: Placement) -> _Predicted:
    est = model.time(job, placement.logical_to_physical)
    return _Predicted(forward_backward_s=est.iteration_time_s - est.breakdown.optimizer_s,
                      passes_s=_passes(est, job), estimate=est)


def _passes(est: TimeEstimate, job: Job) -> np.ndarray:
    """Each stage's forward+backward seconds per iteration in an estimate of `job`."""
    return np.array([s.forward_s + s.backward_s for s in est.stage_times]) * job.num_microbatches


def _clip(x: float, bounds: tuple[float, float]) -> float:
    return float(np.clip(x, *bounds))


def _error(est: TimeEstimate, job: Job, check: CheckResult) -> float:
    """The root mean square of the log ratios of an estimate's iteration time and stage passes to the
    check's (stages no rank of which measured left out)."""
    measured = np.array([check.measured_s, *(s.compute_s for s in check.stages)])
    modelled = np.array([est.iteration_time_s, *_passes(est, job)])
    seen = np.isfinite(measured) & (measured > 0) & (modelled > 0)
    return float(np.sqrt(np.mean(np.log(modelled[seen] / measured[seen]) ** 2)))


def fit(workload: Workload, cluster: Cluster, profile: LayerProfile | None, layout: Layout, placement: Placement,
        check: CheckResult) -> Fit:
    """Factors that make the model reproduce `check`, the self-check of `layout` under `placement`."""
    job = resolve_job(workload, layout)
    measured = np.array([s.compute_s for s in check.stages])
    seen = np.isfinite(measured)
    kinds = link_kinds(cluster, layout)
    notes, at_bound, fitted = [], [], ["compute_rate"]

    def model(rate: float = 1.0, memory: float = 1.0, link: float = 1.0) -> CostModel:
        return calibrated(cluster, profile, Factors(compute_rate=rate, memory_rate=memory,
                                                    link_bandwidth={k: link for k in kinds}))

    raw = _predicted(model(), job, placement).estimate
    optimizer_s = check.measured_s - check.forward_backward_s
    memory = 1.0
    if layout.use_distributed_optimizer and layout.dp > 1 and not layout.overlap_param_gather:
        notes.append("the optimizer step gathers parameters: memory-bound rate left as modelled")
    elif optimizer_s > 0:
        fitted.append("memory_rate")
        memory = raw.breakdown.optimizer_s / optimizer_s
        if _clip(memory, MEMORY_BOUNDS) != memory:
            notes.append(f"the optimizer step is out of range for its memory traffic: memory-bound rate held at "
                         f"x{_clip(memory, MEMORY_BOUNDS):.3g}")
            at_bound.append("memory_rate")
            memory = _clip(memory, MEMORY_BOUNDS)

    def rate_for(link: float) -> float:
        """The compute rate whose passes match the measured ones (least squares over the stages,
        Gauss-Newton in 1 / rate: the passes are piecewise linear in it, the worst replica of a
        stage changing with the rate)."""
        def passes(inverse: float) -> np.ndarray:
            return _predicted(model(1 / inverse, memory, link), job, placement).passes_s[seen]

        inverse = 1.0
        for _ in range(NEWTON_STEPS):
            now = passes(inverse)
            slope = (passes(2 * inverse) - now) / inverse
            step = float(slope @ (measured[seen] - now) / (slope @ slope))
            inverse = max(inverse + step, 1 / (2 * COMPUTE_BOUNDS[1]))
        return 1 / inverse

    def error(u: float) -> float:
        link = math.exp(u)
        return _predicted(model(_clip(rate_for(link), COMPUTE_BOUNDS), memory, link), job,
                          placement).forward_backward_s - check.forward_backward_s

    link = None
    if kinds:
        link = _root(error, *map(math.log, LINK_BOUNDS), notes)
        if link is not None and \
                error(math.log(link / 2)) - error(math.log(link * 2)) < MIN_COMM_SHARE * check.forward_backward_s:
            notes.append(f"halving or doubling the link rates moves this layout's schedule by under "
                         f"{MIN_COMM_SHARE:.0%}: links left as probed")
            link = None
        if link is not None and _clip(rate_for(link), COMPUTE_BOUNDS) != rate_for(link):
            notes.append("matching the schedule through the links would put compute out of range: links left as "
                         "probed")
            link = None
    exact = rate_for(1.0 if link is None else link)
    rate = _clip(exact, COMPUTE_BOUNDS)
    if rate != exact:
        notes.append(f"the passes are out of range for the measured layer times: compute held at x{rate:.3g}")
        at_bound.append("compute_rate")
    links = {} if link is None else {k: link for k in kinds}
    fitted += list(links)
    overhead = 0
    peaks = [s.measured_peak_bytes for s in check.stages]
    if any(p is not None for p in peaks):
        fitted.append("memory_overhead_bytes")
        modelled = model().memory(job).stages
        overhead = max(0, max(p - m.total_bytes for p, m in zip(peaks, modelled) if p is not None))
        if overhead > MAX_OVERHEAD_SHARE * cluster.memory_bytes:
            notes.append(f"a stage peaked {overhead / GiB:.2f} GiB over the model's, more than "
                         f"{MAX_OVERHEAD_SHARE:.0%} of the device")
            at_bound.append("memory_overhead_bytes")
    factors = Factors(compute_rate=rate, memory_rate=memory, link_bandwidth=links, memory_overhead_bytes=overhead)
    after = calibrated(cluster, profile, factors).time(job, placement.logical_to_physical)
    return Fit(factors=factors, predicted_s=raw.iteration_time_s, calibrated_s=after.iteration_time_s,
               measured_s=check.measured_s, predicted_passes_s=tuple(map(float, _passes(raw, job))),
               calibrated_passes_s=tuple(map(float, _passes(after, job))), notes=tuple(notes), fitted=tuple(fitted),
               at_bound=tuple(at_bound), error=_error(after, job, check), uncalibrated_error=_error(raw, job, check),
               device_memory_bytes=cluster.memory_bytes)


def merge(stored: Factors, counts: Mapping[str, int], new: Fit) -> tuple[Factors, dict[str, int]]:
    """The stored calibration of an allocation combined with a new fit of it (AVERAGED_FITS): each
    rate the new check measured becomes the geometric mean of the fits of it, the newest weighted at
    least 1/AVERAGED_FITS; the memory overhead becomes the largest seen (memory is a hard limit: a
    peak one run reached can recur). `counts` says how many fits each factor holds (FACTOR_NAMES);
    the merged counts are returned with the factors."""
    def rate(name: str, old: float, value: float) -> float:
        n = min(counts.get(name, 0), AVERAGED_FITS - 1)
        return math.exp((n * math.log(old) + math.log(value)) / (n + 1))

    f, links = new.factors, dict(stored.link_bandwidth)
    values = {"compute_rate": stored.compute_rate, "memory_rate": stored.memory_rate}
    for name, value in (("compute_rate", f.compute_rate), ("memory_rate", f.memory_rate)):
        if name in new.fitted:
            values[name] = rate(name, values[name], value)
    for kind, value in f.link_bandwidth.items():
        links[kind] = rate(kind, links.get(kind, 1.0), value)
    overhead = stored.memory_overhead_bytes
    if "memory_overhead_bytes" in new.fitted:
        overhead = max(overhead, f.memory_overhead_bytes) if counts.get("memory_overhead_bytes") else \
            f.memory_overhead_bytes
    merged = {name: counts.get(name, 0) + (name in new.fitted) for name in FACTOR_NAMES}
    return Factors(**values, link_bandwidth=links, memory_overhead_bytes=overhead), \
        {name: n for name, n in merged.items() if n}


def _root(error, lo: float, hi: float, notes: list[str]) -> float | None:
    """exp of the root of `error` on [lo, hi] nearest 0 (the link factor), or None with a note."""
    grid = np.linspace(lo, hi, GRID)
    values = [error(u) for u in grid]
    brackets = [(grid[i], grid[i + 1]) for i in range(GRID - 1) if values[i] == 0 or values[i] * values[i + 1] < 0]
    if not brackets:
        side = "above" if min(values) > 0 else "below"
        notes.append(f"the measured time is {side} what any link rate within x{math.exp(lo):.3g}-x{math.exp(hi):.3g} "
                     "gives: links left as probed")
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
