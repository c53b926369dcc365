"""Rank 0's part of a start: what the cache (or a pinned plan) offers this job, and planning from it.

`look_up` decides, in this order:

* a plan pinned with --auto-parallel-plan-file is used if it can run this job (plan_check);
* else the entry's plan (unless --auto-parallel-replan or --auto-parallel-reprobe), if it can run
  this job. With no calibration fitted since it was made it is used as it is; with one, the cached
  probe and layer profile are planned again with the calibrated model and the log says what changed.
  The cached layout stays (with its calibrated prediction, which its next self-check holds it to)
  unless --auto-parallel-replan-if-slower PCT lets a layout the calibrated model finds more than
  PCT% faster replace it: switching layouts reshards the checkpoint, so it is asked for;
* else a plan from the cached probe and layer profile (unless --auto-parallel-reprobe), with the
  calibration if there is one;
* else, for an allocation whose every node another entry's probe measured (by host and GPUs:
  `reuse_measured`), that probe's figures for them, and its layer profile where it is this model's:
  with that entry's plan for the loss of a node (plan.losses) when this allocation is one node
  smaller, placed on these nodes and checked, without a search or a probe; else planned from them;
* else what is missing must be measured (the hook probes and profiles: collectives), and
  `plan_measured` plans from it.

A plan that cannot run this job is a warning, and the job plans again.

At the end of a start's self-check, `calibrate` fits the model to it and stores the calibration the
next start plans with.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_pipette.calibration.check import CheckResult
from megatron_pipette.calibration.document import CalibrationRecord, CalibrationRef
from megatron_pipette.calibration.fit import Factors, Fit, calibrated, fit
from megatron_pipette.cost.memory import environment_overheads
from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import PipetteError
from megatron_pipette.files import read_json
from megatron_pipette.integration.cache import (
    CALIBRATION,
    CLUSTER,
    LOSS_PLAN,
    NODES,
    PLAN,
    PROFILE,
    Document,
    Entry,
    entries_measuring,
    node_index,
)
from megatron_pipette.integration.common import Phases, log
from megatron_pipette.integration.plan_check import JobRequest, measured_problem, plan_problems
from megatron_pipette.plan.losses import place_layouts
from megatron_pipette.plan.planner import Candidate, Plan, evaluate, plan
from megatron_pipette.report.plan_document import PlanRecord
from megatron_pipette.report.plans import plan_report, rejected_by_rule
from megatron_pipette.spec.cluster_file import ClusterFile, NodeIdentity, select_nodes
from megatron_pipette.spec.hardware import Cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import LayerProfile, ProfileFile
from megatron_pipette.units import GiB

TOP_K = 5
LOSS_PLAN_MARGIN = 2.0
"""The plan for a loss is searched when what is left of the budget is this many times the start's own
search (the same search, one node fewer), so that the start ends within its budget."""
PINNED_FLAG = "--auto-parallel-plan-file"


@dataclass(frozen=True, kw_only=True)
class Switches:
    """The flags that choose what a start may reuse."""

    plan_file: Path | None = None
    """--auto-parallel-plan-file."""
    replan: bool = False
    """--auto-parallel-replan: plan again from the cached probe and layer profile."""
    reprobe: bool = False
    """--auto-parallel-reprobe: measure again (which drops the calibration of the old measurements)."""
    replan_if_slower: float | None = None
    """--auto-parallel-replan-if-slower."""


@dataclass(frozen=True)
class Start:
    """What the look-up found: a plan to use, or what there is to plan from once the rest is measured."""

    plan: PlanRecord | None = None
    pinned: bool = False
    cluster: Cluster | None = None
    profile: LayerProfile | None = None
    known: ClusterFile | None = None
    """A probe that measured some of this allocation's nodes, not all: the probe measures the rest
    (schedule.probe_rounds' known_nodes) and takes the pairs it skips from this one (with_known)."""
    known_where: tuple[int | None, ...] = ()
    """Per node of this allocation, its index in `known` (None: a new node)."""
    caching: threading.Thread | None = None
    """The reused probe's figures being written into the entry (reuse_measured), or None."""

    @property
    def known_nodes(self) -> list[bool] | None:
        """What the probe is told it need not measure again (the same on every rank), or None."""
        return None if self.known is None else [k is not None for k in self.known_where]


def look_up(entry: Entry, request: JobRequest, switches: Switches, phases: Phases,
            nodes: Sequence[NodeIdentity] = ()) -> Start:
    """Rank 0: the plan this start uses, or what it must measure first (module docstring); `nodes`:
    which machines this allocation's nodes are."""
    if switches.plan_file is not None:
        pinned = _read_pinned(switches.plan_file)
        problems = [pinned] if isinstance(pinned, str) else plan_problems(pinned, request)
        if not problems:
            log(f"using the plan in {switches.plan_file} (allocation {entry.key}); probe and profile skipped", 0)
            for name in ("probe", "profile", "plan"):
                phases.skip(name, f"skipped ({PINNED_FLAG})")
            return Start(pinned, pinned=True)
        _mismatch(str(switches.plan_file), problems)
    cached = None
    if switches.replan or switches.reprobe:
        log(f"planning again ({'--auto-parallel-reprobe' if switches.reprobe else '--auto-parallel-replan'})", 0)
    else:
        cached = entry.read(PLAN)
    if cached is not None:
        problems = plan_problems(cached, request)
        if not problems:
            return Start(cached_plan(cached, request, switches.replan_if_slower, entry, phases))
        _mismatch(str(entry.file(PLAN)), problems)
    if switches.reprobe:
        return Start()
    cluster, profile = _cached(entry, request)
    reused = Start()
    if cluster is None and nodes:
        reused = reuse_measured(entry, request, nodes, phases)
        if reused.plan is not None:
            return reused
        if reused.known is not None:        # some nodes new: the probe measures them
            return replace(reused, profile=profile or reused.profile)
        cluster, profile = reused.cluster, profile or reused.profile
    if cluster is None or profile is None:
        return Start(cluster=cluster, profile=profile, caching=reused.caching)
    return Start(plan_from_cache(request, entry, cluster, profile, phases), caching=reused.caching)


def _cached(entry: Entry, request: JobRequest) -> tuple[Cluster | None, LayerProfile | None]:
    """The cluster of the entry's probe and its layer profile, each if it is cached and of this job
    (plan_check.measured_problem: a file copied from another allocation's entry, or another model's)."""
    probed = entry.read(CLUSTER, lambda found: measured_problem(request, probed=found))
    profiled = entry.read(PROFILE, lambda found: measured_problem(request, profiled=found))
    return None if probed is None else probed.cluster, None if profiled is None else profiled.profile


def _read_pinned(path: Path) -> PlanRecord | str:
    """The pinned plan, or why it is not one (a file that cannot be read, is no regular file of a
    bounded size, or is not JSON: files.read_json, is an error)."""
    doc = read_json(path, PINNED_FLAG)
    try:
        return PlanRecord.from_json(doc, str(path))
    except PipetteError as e:
        return str(e)


def _mismatch(where: str, problems: list[str]) -> None:
    log(f"WARNING: the plan in {where} cannot run this job ({'; '.join(problems)}): planning again", 0)


def plan_and_write(request: JobRequest, model: CostModel, entry: Entry, phases: Phases,
                   calibration: CalibrationRecord | None = None, result: Plan | None = None) -> PlanRecord:
    """Plan (unless `result` is the search already made with `model`), print the report, and cache the
    document (which names the calibration it used)."""
    result = result or _search(request, model, phases)
    if not result.candidates:
        cluster = model.cluster
        rejected = "; ".join(f"{n} rejected, e.g. {reason}" for n, reason in rejected_by_rule(result)[:3])
        if not result.considered:       # every layout was rejected before memory was asked
            raise PipetteError(f"no layout of this model is valid on {cluster.world_size} devices with the flags "
                               f"as given ({rejected or 'none enumerated'})")
        raise PipetteError(f"no layout of this model fits in {cluster.memory_bytes / GiB:.1f} GiB per device "
                           f"on {cluster.world_size} devices ({result.out_of_memory} of {result.considered} "
                           f"layouts are out of memory" + (f"; {rejected}" if rejected else "") + ")")
    record = _write_plan(result, request, entry, phases, calibration)
    store_loss_plan(request, model, entry, phases, calibration)
    return record


def _search(request: JobRequest, model: CostModel, phases: Phases, phase: str = "plan") -> Plan:
    """The job's search on `model`, timed as `phase`: the start's own, and the one for the loss of a node."""
    return phases.run(phase, lambda: plan(request.workload, model, constraints=request.constraints,
                                          resume=request.checkpoint, top_k=TOP_K,
                                          memory_headroom=request.memory_headroom))


def store_loss_plan(request: JobRequest, model: CostModel, entry: Entry, phases: Phases,
                    calibration: CalibrationRecord | None = None) -> None:
    """The plan for this allocation less one node, cached for the restart after a loss (plan.losses):
    one search on every node but the last, with the same model."""
    cluster = model.cluster
    if cluster.num_nodes < 2:
        return
    searched = phases.seconds.get("plan", 0.0)
    if phases.left() < LOSS_PLAN_MARGIN * searched:
        log(f"no plan stored for the loss of a node: its search (about {searched:.0f} s, as this start's) would "
            f"not fit the {max(phases.left(), 0):.0f} s left of --auto-parallel-budget-s", 0)
        return
    survivors = CostModel(select_nodes(cluster, range(cluster.num_nodes - 1), f"{cluster.name} less a node"),
                          profile=model.profile, overheads=model.overheads, execution=model.execution)
    result = _search(request, survivors, phases, "loss plan")
    if not result.candidates:
        entry.remove(LOSS_PLAN)
        log(f"no layout fits {cluster.num_nodes - 1} node(s): a restart after the loss of a node will search", 0)
        return
    if entry.write(LOSS_PLAN, PlanRecord.from_plan(result, calibration=_reference(calibration)).to_json()):
        log(f"for the loss of a node: {result.best.layout.describe()} on {cluster.num_nodes - 1} node(s), "
            f"stored in {entry.file(LOSS_PLAN)}", 0)


def reuse_measured(entry: Entry, request: JobRequest, nodes: Sequence[NodeIdentity], phases: Phases) -> Start:
    """For an allocation this entry has no probe of: the probe of another entry that measured every one
    of its nodes (by host and GPUs), those nodes' figures cached here; its layer profile where it is
    this model's on these devices; and when that entry's loss plan is for this many nodes, its best
    layout that runs placed on these nodes and checked (plan_problems) as this start's plan. Where no
    probe measured them all, the one that measured most (Start.known), for the probe of the rest;
    Start() when none."""
    partial, partial_profile = Start(), None
    for other in entries_measuring(entry, nodes):
        probed = other.read(CLUSTER)
        where = None if probed is None else probed.nodes_of(nodes)
        if where is None:
            continue
        if None in where:
            if partial.known is None:
                partial_profile = _reused_profile(other, request)
                partial = Start(profile=None if partial_profile is None else partial_profile.profile, known=probed,
                                known_where=tuple(where))
            continue
        name = f"{probed.cluster.name}, {len(nodes)} of its nodes"
        cluster = select_nodes(probed.cluster, where, name)
        phases.skip("probe", "reused")
        log(f"the probe cached in {other.path} measured every node of this allocation: probe skipped", 0)
        profiled, plan = _reused_profile(other, request), None
        if profiled is not None:
            entry.write(PROFILE, profiled.to_json())
            phases.skip("profile", "reused")
            loss = other.read(LOSS_PLAN)
            if loss is not None and loss.world_size == cluster.world_size:
                plan = _take_loss_plan(request, entry, other, loss, cluster, profiled.profile, phases)
        return Start(plan, cluster=cluster, profile=None if profiled is None else profiled.profile,
                     caching=_cache_reused(entry, probed, where, name, nodes))
    if partial.known is not None:
        new = sum(k is None for k in partial.known_where)
        log(f"the probe cached for {partial.known.cluster.name} measured {len(nodes) - new} of this allocation's "
            f"{len(nodes)} nodes: probing the {new} new one(s) and their pairs", 0)
    if partial_profile is not None:
        entry.write(PROFILE, partial_profile.to_json())
        phases.skip("profile", "reused")
    return partial


def _reused_profile(other: Entry, request: JobRequest) -> ProfileFile | None:
    """Another entry's layer profile, where it is of this job's model and devices (measured_problem)."""
    profiled = other.read(PROFILE)
    return None if profiled is None or measured_problem(request, profiled=profiled) else profiled


def _cache_reused(entry: Entry, probed: ClusterFile, where: list[int], name: str,
                  nodes: Sequence[NodeIdentity]) -> threading.Thread:
    """Write this allocation's cluster file (`probed`'s nodes `where`) and node index into `entry`, on a
    thread: at 2048 nodes that is 90 MB and about 0.8 s of rank 0's time, which the start's plan does
    not wait for (the interpreter joins the thread at exit; the next reader is a later start or the
    self-check)."""
    def write() -> None:
        try:
            # Without indentation, which at thousands of nodes takes json's pure-Python encoder.
            entry.write_file(CLUSTER.name, (json.dumps(probed.select(where, name).to_json()) + "\n").encode())
            entry.write(NODES, node_index(nodes))
        except Exception as e:  # noqa: BLE001 (a cache left without it probes again; the job goes on)
            log(f"WARNING: {entry.file(CLUSTER)} not written: {type(e).__name__}: {e}", 0)

    thread = threading.Thread(target=write, name="pipette-cache-write")
    thread.start()
    return thread


def _take_loss_plan(request: JobRequest, entry: Entry, other: Entry, loss: PlanRecord, cluster: Cluster,
                    profile: LayerProfile, phases: Phases) -> PlanRecord | None:
    """The loss plan's best layout that runs here, placed on this allocation's links and checked; None
    (the caller searches) when none can run this job."""
    calibration = other.read(CALIBRATION)
    if calibration is None or loss.calibration is None or calibration.id != loss.calibration.id:
        calibration = None
    model = _calibrated_model(cluster, profile, calibration)
    layouts = [c.layout for c in loss.candidates]
    result = phases.run("plan", lambda: place_layouts(request.workload, model, layouts,
                                                      constraints=request.constraints))
    problems = ["none of its layouts fits"] if not result.candidates else \
        plan_problems(PlanRecord.from_plan(result, calibration=None), request)
    if problems:
        _mismatch(str(other.file(LOSS_PLAN)), problems)
        return None
    log(f"taking the plan for the loss of a node stored in {other.path}: its layouts placed on this "
        "allocation, no search", 0)
    return _write_plan(result, request, entry, phases, calibration)


def _reference(calibration: CalibrationRecord | None) -> CalibrationRef | None:
    """What a plan document says of the calibration it was made with."""
    return None if calibration is None else CalibrationRef(calibration.id, calibration.factors)


def _write_plan(result: Plan, request: JobRequest, entry: Entry, phases: Phases,
                calibration: CalibrationRecord | None) -> PlanRecord:
    """Print the plan (naming the layout flags the search kept) and cache it, saying where and how a
    later start plans again instead of reusing it."""
    print(plan_report(result, fixed=request.constraints), flush=True)
    record = PlanRecord.from_plan(result, phases_s=phases.seconds, calibration=_reference(calibration))
    if entry.write(PLAN, record.to_json()):      # a plan that cannot be cached is still used
        log(f"plan stored in {entry.file(PLAN)} (allocation {entry.key}): a later start of this job on this "
            "allocation reuses it; --auto-parallel-replan plans again from the cached probe and layer profile, "
            "--auto-parallel-reprobe measures again", 0)
    return record


def plan_measured(request: JobRequest, entry: Entry, phases: Phases, cluster: Cluster, profile: LayerProfile,
                  new: dict[Document, dict]) -> PlanRecord:
    """Plan after measuring: `new` maps each document measured by this start (CLUSTER, PROFILE) to its
    JSON, cached here. A calibration is relative to what it was fitted on, so it goes."""
    for doc, value in new.items():
        entry.write(doc, value)
    if new:
        entry.remove(CALIBRATION)
    return plan_and_write(request, CostModel(cluster, profile=profile, overheads=environment_overheads(os.environ)),
                          entry, phases)


def _calibrated_model(cluster: Cluster, profile: LayerProfile, calibration: CalibrationRecord | None) -> CostModel:
    """The cached probe and profile, with the cached calibration's factors when there is one."""
    factors = Factors() if calibration is None else calibration.factors
    if calibration is not None:
        fitted = calibration.fitted_on
        log(f"calibrated model: {factors.describe()} (fitted on a self-check that measured {fitted.measured_s:.3g} "
            f"s/iteration against {fitted.predicted_s:.3g} s predicted)", 0)
    return calibrated(cluster, profile, factors, overheads=environment_overheads(os.environ))


def plan_from_cache(request: JobRequest, entry: Entry, cluster: Cluster, profile: LayerProfile,
                    phases: Phases) -> PlanRecord:
    """A plan from the cached probe and layer profile, calibrated if a calibration is cached."""
    log(f"planning from the probe and layer profile cached in {entry.path} (allocation {entry.key}); probe and "
        "profile skipped", 0)
    phases.skip("probe", "cached")
    phases.skip("profile", "cached")
    calibration = entry.read(CALIBRATION)
    model = _calibrated_model(cluster, profile, calibration)
    result = _search(request, model, phases)
    if calibration is not None and result.considered and not result.candidates:
        log(f"WARNING: with the calibration in {entry.file(CALIBRATION)} (memory overhead "
            f"{calibration.factors.memory_overhead_bytes / GiB:+.2f} GiB per device) no layout fits: it is dropped, "
            "and the job plans uncalibrated", 0)
        entry.remove(CALIBRATION)
        calibration, model = None, _calibrated_model(cluster, profile, None)
        result = _search(request, model, phases)
    return plan_and_write(request, model, entry, phases, calibration, result)


def cached_plan(cached: PlanRecord, request: JobRequest, replan_if_slower: float | None, entry: Entry,
                phases: Phases) -> PlanRecord:
    """The cached plan (checked), planned again if a calibration was fitted since."""
    path = entry.file(PLAN)
    for name in ("probe", "profile"):
        phases.skip(name, "cached")
    calibration = entry.read(CALIBRATION)
    if calibration is None or (cached.calibration is not None and calibration.id == cached.calibration.id):
        log(f"using the plan in {path} (allocation {entry.key}); probe and profile skipped "
            "(--auto-parallel-replan plans again)", 0)
        phases.skip("plan", "cached")
        return cached
    cluster, profile = _cached(entry, request)
    if cluster is None or profile is None:
        log(f"using the plan in {path} (allocation {entry.key}) uncalibrated: the probe or layer profile it was "
            "made from is not cached", 0)
        phases.skip("plan", "cached")
        return cached
    log(f"a self-check calibrated the model since {path} was made: planning again from the probe and "
        f"layer profile cached there (allocation {entry.key})", 0)
    model = _calibrated_model(cluster, profile, calibration)
    result = _search(request, model, phases)
    layout, placement = cached.best.layout, cached.best.placement
    job = resolve_job(request.workload, layout)
    time, memory = evaluate(model, job, placement)
    kept = Candidate(layout=layout, placement=placement, time=time, memory=memory,
                     default_order_time_s=model.time(job).iteration_time_s)
    log(f"{layout.describe()}: predicted {time.iteration_time_s:.3g} s/iteration by the calibrated model, "
        f"{cached.best.iteration_time_s:.3g} s before", 0)
    chosen = _choose(kept, result.best, replan_if_slower)
    others = [c for c in result.candidates if (c.layout, c.placement) != (chosen.layout, chosen.placement)]
    return _write_plan(replace(result, candidates=(chosen, *others)[:TOP_K]), request, entry, phases,
                       calibration)


def _choose(kept: Candidate, best: Candidate | None, replan_if_slower: float | None) -> Candidate:
    """The cached layout, or the calibrated best where --auto-parallel-replan-if-slower allows; logged."""
    if best is None:
        log("the calibrated model fits no layout; keeping the cached one, which ran", 0)
        return kept
    if (best.layout, best.placement) == (kept.layout, kept.placement):
        log("the calibrated model keeps it as the best layout", 0)
        return best
    gain = 1 - best.time.iteration_time_s / kept.time.iteration_time_s
    log(f"the calibrated model's best is {best.layout.describe()}: {best.time.iteration_time_s:.3g} s/iteration, "
        f"{gain:.1%} faster", 0)
    if replan_if_slower is None:
        log("keeping the cached layout; --auto-parallel-replan-if-slower PCT switches when another is more than "
            "PCT% faster", 0)
        return kept
    if gain * 100 > replan_if_slower:
        log(f"switching to {best.layout.describe()} (--auto-parallel-replan-if-slower {replan_if_slower:g})", 0)
        return best
    log(f"keeping the cached layout: not more than {replan_if_slower:g}% faster "
        "(--auto-parallel-replan-if-slower)", 0)
    return kept


def calibrate(entry: Entry, planned: PlanRecord, result: CheckResult) -> Fit | None:
    """Fit the model's factors to the self-check `result` of `planned` and store them merged with the
    allocation's stored ones (CalibrationRecord.of), unless the fit is refused (Fit.refusal: one line
    says why); the fit, or None without the allocation's probe and profile. Under the entry's lock."""
    probed, profiled = entry.read(CLUSTER), entry.read(PROFILE)
    if probed is None or profiled is None:
        log(f"not calibrated: {entry.path} has no probe and layer profile of this allocation", 0)
        return None
    layout, placement = planned.best.layout, planned.best.placement
    fitted = fit(planned.model, probed.cluster, profiled.profile, layout, placement, result)
    log(fitted.line(), 0)
    if (why := fitted.refusal()) is not None:
        log(f"calibration not stored: {why}", 0)
        return fitted
    stored = entry.read(CALIBRATION)
    record = CalibrationRecord.of(fitted, layout, placement, result, stored)
    if entry.write(CALIBRATION, record.to_json()):
        merged = "" if stored is None else \
            f" (merged with {stored.combined} earlier self-check(s): {record.factors.describe()})"
        log(f"calibration stored in {entry.file(CALIBRATION)}{merged}: the next start on this allocation plans "
            "with it", 0)
    return fitted
