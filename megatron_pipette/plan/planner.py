"""The planner: every valid layout, pruned by memory, ranked by predicted time, placed.

1. Enumerate the layouts Megatron accepts (plan.search), honouring constraints.
2. Drop every layout whose worst pipeline stage does not fit (cost.memory). Where full
   recomputation of every layer fits, recompute only as many as the memory needs
   (`--recompute-method block`, the fewest layers per model chunk that fit).
3. Rank the rest by the closed-form iteration time in Megatron's default order, skipping a job
   whose compute alone, with the pipeline's fill and drain (CostModel.time_bound), is slower than
   the slowest one kept (and, for the layouts with room, than the fastest within HEADROOM_TIME).
4. For the best few, search a node placement that minimises the same time
   (plan.placement) and re-rank; the event-driven simulator re-checks them.
5. Pick with headroom: the fastest layout, unless less than `memory_headroom` of the device is left
   free on its fullest stage and a layout within HEADROOM_TIME of its time leaves that much; then the
   fastest of those (Plan.passed_over names the faster one). If none does, the fastest that fits.
Pure: no torch, no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from megatron_pipette.cost.memory import MemoryEstimate
from megatron_pipette.cost.model import CostModel
from megatron_pipette.cost.timing import TimeEstimate
from megatron_pipette.plan.placement import Placement, default_placement, optimize_placement
from megatron_pipette.plan.search import RECOMPUTE_FLAGS, Rejections, enumerate_layouts
from megatron_pipette.spec.hardware import Cluster
from megatron_pipette.spec.job import Job, resolve_job
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.resume import ResumeRule
from megatron_pipette.spec.workload import Workload
from megatron_pipette.units import GiB

MEMORY_HEADROOM = 0.05
"""Default share of a device's memory a pick leaves free (--memory-headroom,
--auto-parallel-memory-headroom): the memory model is within 2% on layers measured (TIGHT_HEADROOM)
but the allocator's fragmentation and what it does not model (NCCL's lazily allocated buffers, a
longer sequence in a batch) take a few GiB more of 80; a job that runs out of memory loses everything,
a layout a few % slower loses a few %."""
HEADROOM_TIME = 0.02
"""A layout with headroom replaces a faster one without it only within this share of its time:
below the time model's own error (mean |error| 6-7% on published runs), so the two are as fast as
the model can tell."""
ROOMY_KEPT = 3
"""Layouts with headroom kept besides the fastest ones (and placed), for the pick."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One ranked layout with its placement and predictions."""

    layout: Layout
    placement: Placement
    time: TimeEstimate
    """Predicted with the placement applied; the ranking key."""
    default_order_time_s: float
    """Predicted time in Megatron's default rank order, for comparison."""
    memory: MemoryEstimate
    simulated_time_s: float | None = None
    """The event-driven simulator's figure for the same placement, for top candidates whose
    schedule time was not exact (None otherwise: the estimate is the simulator's answer)."""


class _Kept(NamedTuple):
    """A layout a heap of plan() keeps, ordered as heapq keeps it: the slowest first, of equally
    slow ones the first enumerated."""

    negated_time_s: float
    """Minus the predicted time (heapq pops the smallest)."""
    enumerated: int
    """The layout's place in the enumeration."""
    job: Job
    time: TimeEstimate
    memory: MemoryEstimate


@dataclass(frozen=True, kw_only=True)
class Plan:
    workload: Workload
    cluster_name: str
    world_size: int
    candidates: tuple[Candidate, ...]
    """Fitting layouts, best first (at most top_k)."""
    considered: int
    """Layouts enumerated."""
    out_of_memory: int
    """Layouts dropped because a stage does not fit."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Layouts Megatron would reject, counted by reason (numbers generalised)."""
    rejection_examples: dict[str, str] = field(default_factory=dict)
    """The first rejection of each reason in `rejected`, as it read."""
    closest_misfit: tuple[Layout, MemoryEstimate] | None = None
    """When nothing fits: the layout that came closest, to explain what would."""
    memory_headroom: float = 0.0
    """The share of device memory the pick was to leave free (step 5 of the module docstring)."""
    passed_over: Candidate | None = None
    """The fastest layout, when the pick is another that leaves the headroom it does not."""

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


def plan(workload: Workload, model: CostModel, *, constraints: Mapping[str, Any] | None = None, top_k: int = 10,
         placement_top: int = 3, allow_tp_across_nodes: bool = False, resume: ResumeRule | None = None,
         memory_headroom: float = MEMORY_HEADROOM, preferred: Mapping[str, Any] | None = None) -> Plan:
    """Search every valid layout for the model's cluster (that can load the checkpoint to resume from,
    given `resume`; with the `preferred` settings wherever Megatron accepts them, enumerate_layouts) and
    return the best ones, placed, the pick first (step 5 of the module docstring)."""
    cluster = model.cluster
    considered = oom = 0
    rejected = Rejections()
    closest: tuple[Layout, MemoryEstimate] | None = None
    heap: list[_Kept] = []
    roomy: list[_Kept] = []
    """The fastest layouts that leave `memory_headroom` free, within HEADROOM_TIME of the fastest."""
    fastest = math.inf
    keep = max(top_k, placement_top)

    def limit(has_room: bool) -> float:
        """The time above which a job can enter neither list."""
        slowest = heap[0].time.iteration_time_s if len(heap) == keep else math.inf
        if not has_room:
            return slowest
        return max(slowest, min(roomy[0].time.iteration_time_s if len(roomy) == ROOMY_KEPT else math.inf,
                                (1 + HEADROOM_TIME) * fastest))

    tune_recompute = not any(k in (constraints or {}) for k in RECOMPUTE_FLAGS)
    for job in enumerate_layouts(workload, cluster.world_size, cluster.gpus_per_node, constraints,
                                 allow_tp_across_nodes=allow_tp_across_nodes,
                                 gpus_per_domain=cluster.gpus_per_domain, rejected=rejected, resume=resume,
                                 preferred=preferred):
        considered += 1
        memory = model.memory(job)
        variants = [(job, memory)]
        if memory.fits and tune_recompute:
            if model.time_bound(job, recompute=False) > limit(memory.headroom >= memory_headroom):
                continue                  # slower than the slowest kept under any recomputation
            variants = [least_recompute(model, job, memory)]
            if variants[0][1].headroom < memory_headroom:      # a few layers more may leave the margin
                roomier = least_recompute(model, job, memory, memory_headroom)
                variants += [roomier] if roomier[0].layout != variants[0][0].layout else []
        if not variants[0][1].fits:
            oom += 1
            if closest is None or memory.peak_bytes / memory.capacity_bytes < \
                    closest[1].peak_bytes / closest[1].capacity_bytes:
                closest = (job.layout, memory)
            continue
        for job, memory in variants:
            has_room = memory.headroom >= memory_headroom
            if model.time_bound(job) > limit(has_room):
                continue                  # slower than the slowest kept, whatever its links
            time = model.time(job)
            fastest = min(fastest, time.iteration_time_s)
            entry = _Kept(negated_time_s=-time.iteration_time_s, enumerated=considered, job=job, time=time,
                          memory=memory)
            for kept, size in ((heap, keep), *(((roomy, ROOMY_KEPT),) if has_room else ())):
                if len(kept) < size:
                    heapq.heappush(kept, entry)
                elif entry > kept[0]:
                    heapq.heapreplace(kept, entry)
    def fastest_first(kept: _Kept) -> tuple[float, int]:
        return kept.time.iteration_time_s, kept.enumerated

    ranked = sorted(heap, key=fastest_first)
    ranked += sorted((e for e in roomy if e not in heap), key=fastest_first)
    identity = default_placement(cluster)
    candidates = []
    for i, kept in enumerate(ranked):
        placement, placed_time = identity, kept.time
        if i < placement_top or i >= len(heap):
            placement, placed_time = optimize_placement(model, kept.job)
        candidates.append((kept.job, Candidate(layout=kept.job.layout, placement=placement, time=placed_time,
                                               default_order_time_s=kept.time.iteration_time_s,
                                               memory=kept.memory)))
    candidates.sort(key=lambda jc: jc[1].time.iteration_time_s)
    fastest_candidate = candidates[0][1] if candidates else None
    candidates = _with_headroom_first(candidates, memory_headroom)
    chosen = [replace(c, simulated_time_s=model.time(job, c.placement.logical_to_physical,
                                                     simulate=True).iteration_time_s)
              if i < placement_top and not c.time.exact_schedule else c
              for i, (job, c) in enumerate(candidates[:top_k])]
    passed_over = fastest_candidate if candidates and candidates[0][1] is not fastest_candidate else None
    return Plan(workload=workload, cluster_name=cluster.name, world_size=cluster.world_size,
                candidates=tuple(chosen), considered=considered, out_of_memory=oom, rejected=dict(rejected.counts),
                rejection_examples=dict(rejected.examples),
                closest_misfit=closest,
                memory_headroom=memory_headroom, passed_over=passed_over)


def _with_headroom_first(candidates: list[tuple[Job, Candidate]], headroom: float) -> list[tuple[Job, Candidate]]:
    """Candidates ordered by time, sorted so, with the pick first (step 5 of the module docstring)."""
    if not candidates or candidates[0][1].memory.headroom >= headroom:
        return candidates
    fastest = candidates[0][1].time.iteration_time_s
    for i, (_, c) in enumerate(candidates):
        if c.time.iteration_time_s > (1 + HEADROOM_TIME) * fastest:
            break
        if c.memory.headroom >= headroom:
            return [candidates[i], *candidates[:i], *candidates[i + 1:]]
    return candidates


def least_recompute(model: CostModel, job: Job, memory: MemoryEstimate,
                    headroom: float = 0.0) -> tuple[Job, MemoryEstimate]:
    """For a job that recomputes every layer (`--recompute-method uniform --recompute-num-layers 1`)
    and fits: the same job recomputing only the first k layers of each model chunk (`block k`),
    with the smallest k that fits leaving `headroom` of the device free, when one below every layer
    does. Memory falls and time rises with k (each recomputed layer stores its input instead of its
    activations and runs its forward again), so the smallest such k is the fastest; a bisection
    finds it."""
    layout = job.layout
    if (layout.recompute_granularity, layout.recompute_method, layout.recompute_num_layers) != ("full", "uniform", 1):
        return job, memory
    chunk = min(len(c) for stage in job.chunk_layers() for c in stage)
    best = (job, memory)
    low, high = 1, chunk - 1                  # block `chunk` recomputes every layer, as uniform 1 does
    while low <= high:
        k = (low + high) // 2
        trial = resolve_job(job.workload, replace(layout, recompute_method="block", recompute_num_layers=k))
        estimate = model.memory(trial)
        if estimate.fits and estimate.headroom >= headroom:
            best, high = (trial, estimate), k - 1
        else:
            low = k + 1
    return best


def evaluate(model: CostModel, job: Job, placement: Placement | None = None) -> tuple[TimeEstimate, MemoryEstimate]:
    """Predict one given job (any layout Megatron accepts, TP across nodes included)."""
    placement = placement or default_placement(model.cluster)
    return model.time(job, placement.logical_to_physical), model.memory(job)


def misfit_advice(workload: Workload, cluster: Cluster, result: Plan) -> list[str]:
    """What would make something fit, for the 'nothing fits' message (of a search in which some
    layout was valid: report.plans.no_valid_layout speaks for the others)."""
    assert result.closest_misfit is not None, "no valid layout: nothing to advise on memory"
    layout, memory = result.closest_misfit
    worst = memory.worst_stage
    advice = [f"closest: {layout.describe()} needs {worst.total_bytes / GiB:.1f} GiB on pipeline stage "
              f"{worst.stage} of {memory.capacity_bytes / GiB:.1f} GiB"]
    static = worst.weight_bytes + worst.gradient_bytes + worst.optimizer_bytes
    if layout.recompute_granularity != "full":
        advice.append("try --recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    if layout.micro_batch_size > 1:
        advice.append("try a smaller --micro-batch-size")
    factor = memory.peak_bytes / memory.capacity_bytes
    if static > memory.capacity_bytes * 0.5 or factor > 1:
        more = cluster.world_size * max(2, int(factor + 1))
        advice.append(f"or more GPUs: parameters, gradients and optimizer state alone take "
                      f"{static / GiB:.1f} GiB per GPU here; about {more} GPUs would leave room")
    return advice
