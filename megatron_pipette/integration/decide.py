"""The hook's decision: the one `StartPlan` every rank trains with, or the agreed fallback to the flags as given.

Rank 0 finds the checkpoint to resume and looks the job up (replan.look_up: a pinned or cached plan, or
what is missing), and broadcasts what it found; every rank probes what the cache lacks, rank 0 profiles
the shapes the search may ask for (search.profile_shapes) and plans, and broadcasts the plan. Then the
ranks agree through the store: all hold the same plan, or all fall back (or stop) together. Kept apart
from start and apply so that the collectives and the failure semantics of deciding live in one place.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_pipette.errors import PipetteError, UnresumableCheckpoint, UnrunnableFlags
from megatron_pipette.integration import checkpoint, megatron_args, options, replan
from megatron_pipette.integration.cache import CLUSTER, NODES, PROFILE, Entry, cache_key, node_identities, node_index
from megatron_pipette.integration.common import Phases, exit_with, log
from megatron_pipette.integration.plan_check import JobRequest, typed_problem, unresumable
from megatron_pipette.integration.rehearsal import rehearsal_requested
from megatron_pipette.integration.start import Started, close_quietly, control_group
from megatron_pipette.plan.search import profile_shapes
from megatron_pipette.probe.document import gpus_per_node
from megatron_pipette.probe.identity import gpu_id, node_name
from megatron_pipette.report.plan_document import PlanRecord
from megatron_pipette.spec.cluster_file import ClusterFile
from megatron_pipette.spec.layout import Layout
from megatron_pipette.units import MiB

PROBE_SHARE = 0.4
"""Share of the budget the link probe may use; the layer profile gets PROFILE_SHARE."""
PROFILE_SHARE = 0.3
LOCK_SHARE = 0.5
"""Share of the budget rank 0 may wait for another job planning into the same cache entry."""


@dataclass(frozen=True)
class StartPlan:
    """What this start trains with, the same on every rank (rank 0 decides it and broadcasts it)."""

    plan: PlanRecord | None
    """None: planning failed and every rank agreed to train with the flags as given (`fallback`)."""
    entry: Entry | None = None
    """The cache entry whose plan.json `plan` is, which the self-check calibrates; None when the plan
    is pinned with --auto-parallel-plan-file."""
    resume: checkpoint.Resume | None = None
    """The checkpoint this start resumes from, and what a layout must keep to load it."""
    fallback: Layout | None = None
    """The flags as given (a micro-batch of 1 where the planner was to choose it), when `plan` is None."""


@dataclass(frozen=True)
class Missing:
    """What rank 0's look-up found missing from the cache: the ranks measure it together."""

    probe: bool
    profile: bool
    known_nodes: list[bool] | None
    """The nodes a cached probe measured, whose pairs the probe skips (replan.Start.known_nodes)."""


def decide(started: Started, args: Any, argv: list[str], opts: Any) -> StartPlan:
    """Collective: the plan of this start, or the fallback every rank agreed on; SystemExit (on every rank)
    where the job must stop: flags that cannot run here (UnrunnableFlags) or resume the checkpoint
    (UnresumableCheckpoint), a missing rank, or --auto-parallel-strict."""
    rank, world, phases = started.rank, started.world, started.phases
    fallback = megatron_args.layout_from_args(args, world)
    resume, chosen = None, None
    try:
        group = control_group(started.backend, started.timeout)
        resume = _on_rank0_then_broadcast(lambda: checkpoint.find_resume(args), rank, group)
        chosen = _plan(started, args, argv, opts, resume, group)
        placement = chosen.plan.best.placement
        if placement.logical_to_physical.size != world:
            raise PipetteError(f"the plan is for {placement.logical_to_physical.size} processes, this job has {world}")
        status = f"ok:{chosen.plan.best.digest()}"
    except Exception as e:  # any failure falls back (or stops) on every rank, together
        why = str(e) if isinstance(e, PipetteError) else f"{type(e).__name__}: {e}"
        kind = "stop" if isinstance(e, UnrunnableFlags) else "failed"
        status = f"{kind}:{why}".replace("\n", " ")[:1000]
    if phases.elapsed() > opts.auto_parallel_budget_s:
        status = f"failed:budget of {opts.auto_parallel_budget_s:g} s exceeded ({phases.elapsed():.0f} s)"
    # Peers stuck in a collective with a failed rank give up after the timeout; wait longer.
    statuses = _agree(started.store, started.prefix("status"), rank, world, status, 2 * started.timeout)
    if len(set(statuses)) == 1 and statuses[0].startswith("ok:"):
        return chosen
    reason, stop = failure_verdict(statuses)
    if stop:
        close_quietly()
        exit_with(f"auto-parallel failed: {reason}" + checkpoint.restarts_note())
    if resume is not None and (unkept := resume.rule.unkept(fallback)):
        close_quietly()    # training on would only fail in Megatron's load_checkpoint
        exit_with(f"auto-parallel failed: {reason}; the flags as given cannot resume the checkpoint in "
                  f"{resume.where}: {'; '.join(unkept)}" + checkpoint.restarts_note())
    if opts.auto_parallel_strict:
        close_quietly()
        exit_with(f"auto-parallel failed (--auto-parallel-strict): {reason}")
    if opts.auto_parallel_dry_run:     # it asked for a plan, and there is none: not a success (exit 1)
        close_quietly()
        exit_with(f"auto-parallel failed (--auto-parallel-dry-run): planning failed ({reason}); no plan "
                  "to print, nothing trained")
    left_open = ""
    if fallback.micro_batch_size is None:     # left to the planner; Megatron cannot start without one
        fallback, left_open = replace(fallback, micro_batch_size=1), " (--micro-batch-size, not given: 1)"
    log(f"WARNING: planning failed ({reason}); training with the flags as given{left_open}: "
        f"{fallback.describe()}", rank)
    return StartPlan(None, resume=resume, fallback=fallback)


def _identity() -> dict:
    """This process's part of the cache key: its node, its device and which GPU it is (the UUID where
    torch shows it, else CUDA_VISIBLE_DEVICES), so that jobs on disjoint GPUs of a node do not share."""
    if torch.cuda.is_available() and not rehearsal_requested():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return {"host": node_name(), "device": torch.cuda.get_device_properties(device).name, "gpu": gpu_id(device)}
    return {"host": node_name(), "device": "cpu", "gpu": gpu_id(torch.device("cpu"))}


def _broadcast(obj: Any, rank: int, group: dist.ProcessGroup | None) -> Any:
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _on_rank0_then_broadcast(work: Callable[[], Any], rank: int, group: dist.ProcessGroup | None) -> Any:
    """Run `work` on rank 0 and give every rank its result, or its error: the other ranks wait in
    the broadcast, so rank 0 must reach it even when `work` fails."""
    result, error = None, None
    if rank == 0:
        try:
            result = work()
        except Exception as e:  # reported on every rank by the caller's fallback
            error = e if isinstance(e, PipetteError) else f"{type(e).__name__}: {e}"
    result, error = _broadcast((result, error) if rank == 0 else None, rank, group)
    if error is not None:
        raise error if isinstance(error, PipetteError) else PipetteError(f"rank 0: {error}")
    return result


def _plan(started: Started, args: Any, argv: list[str], opts: Any, resume: checkpoint.Resume | None,
          group: dist.ProcessGroup | None) -> StartPlan:
    """Collective: the StartPlan, identical on every rank: rank 0's look-up, else planned once the
    ranks have measured what it found missing."""
    rank, world, phases = started.rank, started.world, started.phases
    identities: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(identities, _identity(), group=group)
    request = megatron_args.job_request(args, argv, world, gpus_per_node([i["host"] for i in identities]),
                                        None if resume is None else resume.rule)
    if (note := megatron_args.overridden_by_checkpoint(request)) is not None:
        log(f"WARNING: {note}", rank)
    hosts = [i["host"] for i in identities]     # what a cached probe must have measured (measured_problem)
    request = replace(request, nodes=tuple(hosts[::request.gpus_per_node]), device_name=identities[0]["device"],
                      transformer_engine=megatron_args.transformer_engine_in_use(args))
    root, chosen_by = options.cache_dir(opts)
    entry = Entry(root, cache_key(identities, request.workload, request.typed),
                  shared=opts.auto_parallel_shared_cache, flag=chosen_by)
    switches = replan.Switches(plan_file=opts.auto_parallel_plan_file, replan=opts.auto_parallel_replan,
                               reprobe=opts.auto_parallel_reprobe, replan_if_slower=opts.auto_parallel_replan_if_slower)
    budget = opts.auto_parallel_budget_s
    with contextlib.ExitStack() as held:   # rank 0 holds the entry's lock until the plan is made
        found: list[replan.Start] = []

        def look_up() -> StartPlan | Missing:
            if (why := typed_problem(request)) is not None:
                raise UnrunnableFlags(why)      # before probing: the flags as given cannot run either
            if resume is not None and (why := unresumable(request, resume.where)) is not None:
                raise UnresumableCheckpoint(why)   # before probing or Megatron's load
            entry.open()
            waited = held.enter_context(entry.locked(LOCK_SHARE * budget))
            if waited >= 1:
                log(f"waited {waited:.0f} s for another job to release {entry.path}", 0)
            start = replan.look_up(entry, request, switches, phases,
                                   nodes=node_identities(identities, request.gpus_per_node))
            found.append(start)
            if start.plan is not None:
                return StartPlan(start.plan, entry=None if start.pinned else entry, resume=resume)
            return Missing(probe=start.cluster is None, profile=start.profile is None, known_nodes=start.known_nodes)

        decided = _on_rank0_then_broadcast(look_up, rank, group)
        if isinstance(decided, StartPlan):
            return decided
        plan = _measure_and_plan(request, entry, found[0] if found else None, decided, started, budget, group)
        return StartPlan(plan, entry=entry, resume=resume)


def _measure_and_plan(request: JobRequest, entry: Entry, start: replan.Start | None, missing: Missing,
                      started: Started, budget: float, group: dist.ProcessGroup | None) -> PlanRecord:
    """Collective: probe (every rank) and profile (rank 0) what the cache lacks, then plan on rank 0."""
    workload, phases = request.workload, started.phases
    on_gpu = torch.cuda.is_available() and not rehearsal_requested()
    probed = None
    if missing.probe:
        from megatron_pipette.probe import run_probe

        probed = phases.run("probe", lambda: run_probe(
            budget_s=budget * PROBE_SHARE, precision=workload.precision if on_gpu else "fp32",
            small_bytes=4096, large_bytes=64 * MiB if on_gpu else MiB, repeats=3,
            timeout_s=started.timeout.total_seconds(), known_nodes=missing.known_nodes))   # rank 0 only
    else:
        phases.skip("probe", "cached")

    def plan() -> PlanRecord:
        return _profile_and_plan(request, start, probed, entry, on_gpu, budget, phases)

    if not missing.profile:
        phases.skip("profile", "cached")
        return _on_rank0_then_broadcast(plan, started.rank, group)
    from megatron.core import parallel_state

    # The profiler builds megatron-core modules, which need model-parallel state; set up a
    # neutral one (a collective) and tear it down before Megatron builds the real one.
    parallel_state.initialize_model_parallel(1, 1)
    try:
        return _on_rank0_then_broadcast(plan, started.rank, group)
    finally:
        parallel_state.destroy_model_parallel()


def _profile_and_plan(request: JobRequest, start: replan.Start, probed: ClusterFile | None, entry: Entry,
                      on_gpu: bool, budget: float, phases: Phases) -> PlanRecord:
    """Rank 0: the cluster (probed now, or cached), the layer profile (profiled now, or cached), the plan."""
    new = {}
    cluster = start.cluster
    if probed is not None:
        if start.known is not None:     # the pairs of nodes measured before, as measured then
            probed = probed.with_known(start.known, start.known_where)
        cluster, new[CLUSTER] = probed.cluster, probed.to_json()
        if probed.node_identities is not None:      # what a later allocation on some of these nodes finds
            new[NODES] = node_index(probed.node_identities)
        log(f"probed {cluster.world_size} devices on {cluster.num_nodes} node(s) in {phases.seconds['probe']:.1f} s",
            0)
    profile = start.profile
    if profile is None:
        # The sizes the search may ask the profile for, by its own rules (megatron_args pins CP 1 where
        # Transformer Engine is missing); context-parallel shards are timed last, so a budget cut drops
        # them first. With none, no layout is valid, and the search says why.
        shapes = profile_shapes(request.workload, cluster.world_size, cluster.gpus_per_node, request.constraints,
                                gpus_per_domain=cluster.gpus_per_domain, resume=request.checkpoint)
        if shapes.tp_sizes:
            from megatron_pipette.profile import profile_layers

            profiled = phases.run("profile", lambda: profile_layers(
                request.workload, tp_sizes=shapes.tp_sizes, micro_batch_sizes=shapes.micro_batch_sizes,
                device="cuda" if on_gpu else "cpu", budget_s=budget * PROFILE_SHARE, rank=0,
                cp_sizes=shapes.cp_sizes))
            profile, new[PROFILE] = profiled.profile, profiled.to_json()
    return replan.plan_measured(request, entry, phases, cluster, profile, new)


def _agree(store: dist.Store, prefix: str, rank: int, world: int, status: str, timeout: timedelta) -> list[str]:
    """Every rank's status, exchanged through the store (which outlives a broken process group). A rank
    that has not posted within `timeout` (hung or dead) is "missing". The first rank to decide writes the
    verdict (compare_set) and every rank, a late one included, takes it: all act on the same statuses."""
    store.set(f"{prefix}{rank}", status)
    keys = [f"{prefix}{r}" for r in range(world)]
    with contextlib.suppress(dist.DistStoreError):   # a rank did not post in time: it is missing
        store.wait(keys, timeout)
    seen = [store.get(k).decode() if store.check([k]) else
            f"missing:no answer within {timeout.total_seconds():.0f} s (hung or dead)" for k in keys]
    return json.loads(store.compare_set(f"{prefix}verdict", "", json.dumps(seen)))


def failure_verdict(statuses: list[str]) -> tuple[str, bool]:
    """From the ranks' statuses ("ok:<plan digest>", "failed:<why>", "stop:<why>", "missing:<why>") when
    they do not all hold one plan: the reason naming each failed rank, and whether to stop even without
    --auto-parallel-strict (some rank's failure is a flag the user's own line cannot run with, or a rank
    is missing, without which no training group can form)."""
    failures: dict[str, list[int]] = {}
    missing = any(s.startswith("missing:") for s in statuses)
    for r, s in enumerate(statuses):
        if s.startswith("missing:") if missing else not s.startswith("ok:"):   # a missing rank is why others failed
            failures.setdefault(s.split(":", 1)[1], []).append(r)
    reason = "; ".join(f"rank {','.join(map(str, ranks))}: {why}" for why, ranks in failures.items()) \
        or "ranks hold different plans"
    return reason, missing or any(s.startswith("stop:") for s in statuses)
