"""The pre-launch hook behind `--auto-parallel`, run inside Megatron's validate_args.

On every rank, before Megatron derives anything from the layout flags:

0. without a GPU, turn on the CPU rehearsal and supply the settings it needs
   that the command line leaves out; keep prebuilt dataset helpers (dropin);
1. initialise torch.distributed from the torchrun environment (a probe group);
2. identify the allocation; a plan pinned or cached for the same allocation
   and model is checked against the job (plan_check) and reused (planned
   again if a self-check calibrated the model since; a cached probe without a
   plan is planned from: replan), else probe the links and devices and
   profile one layer (rank 0), whatever the cache (integration.cache) lacks;
3. plan on rank 0, broadcast the plan, and agree through the store that every
   rank holds the same one (a failed rank says so instead of leaving the
   others waiting);
4. re-initialise torch.distributed with the placement's ranks and rewrite
   Megatron's layout arguments; Megatron then continues as if the user had
   typed the chosen flags;
5. arm the self-check of the first iterations under the plan (selfcheck).

If anything fails or runs past the budget, every rank falls back to the
user's own flags with one warning (or stops, with --auto-parallel-strict, or
when those flags cannot run here either: errors.UnrunnableFlags).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_pipette.errors import PipetteError, UnresumableCheckpoint, UnrunnableFlags
from megatron_pipette.integration import checkpoint, dropin, megatron_args, options, replan, selfcheck
from megatron_pipette.integration.cache import CLUSTER, NODES, PROFILE, Entry, cache_key, node_identities, node_index
from megatron_pipette.integration.common import Phases, log
from megatron_pipette.integration.groups import distinct_groups, group_sizes
from megatron_pipette.integration.plan_check import JobRequest, typed_problem, unresumable
from megatron_pipette.integration.rehearsal import enable_cpu_rehearsal, rehearsal_requested
from megatron_pipette.integration.reinit import init_from_torchrun_env, reinit_with_ranks
from megatron_pipette.plan.placement import Placement
from megatron_pipette.plan.search import context_parallel_options
from megatron_pipette.probe.document import gpus_per_node
from megatron_pipette.probe.identity import gpu_id, node_name
from megatron_pipette.report.plan_document import PlanRecord
from megatron_pipette.spec.cluster_file import ClusterFile
from megatron_pipette.spec.layer_profile import ProfileFile
from megatron_pipette.spec.layout import Layout
from megatron_pipette.units import GiB, MiB

PROBE_SHARE = 0.4
"""Share of the budget the link probe may use; the layer profile gets PROFILE_SHARE."""
PROFILE_SHARE = 0.3
LOCK_SHARE = 0.5
"""Share of the budget rank 0 may wait for another job planning into the same cache entry."""
PROFILE_MICRO_BATCHES = (1, 2, 4, 8)
MIN_WAIT_S = 30.0
"""Shortest timeout of a pre-launch wait (process start-up skew across nodes)."""


def _identity() -> dict:
    """This process's part of the cache key: its node, its device and which GPU it is (the UUID where
    torch shows it, else CUDA_VISIBLE_DEVICES), so that jobs on disjoint GPUs of a node do not share."""
    if torch.cuda.is_available() and not rehearsal_requested():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return {"host": node_name(), "device": torch.cuda.get_device_properties(device).name, "gpu": gpu_id(device)}
    return {"host": node_name(), "device": "cpu", "gpu": gpu_id(torch.device("cpu"))}


def control_group(backend: str, timeout: timedelta) -> dist.ProcessGroup | None:
    """The group the pre-launch phase exchanges its plan and identities in: gloo, whose collectives
    raise when a peer stops answering within `timeout`, where NCCL's watchdog would instead tear the
    process down with a traceback; None (the default group) when that already is gloo. The probe
    still measures on the job's own backend."""
    return None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)


def _broadcast(obj: Any, rank: int, group: dist.ProcessGroup | None) -> Any:
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _plan_on_rank0(args: Any, argv: list[str], opts: Any, rank: int, world: int, phases: Phases,
                   timeout: timedelta, resume: checkpoint.Resume | None,
                   group: dist.ProcessGroup | None) -> tuple[PlanRecord, Entry | None]:
    """Collective: the plan, identical on every rank, and the cache entry whose plan.json it
    is (None when it is pinned with --auto-parallel-plan-file)."""
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

        def look_up() -> tuple[PlanRecord | None, bool, bool, bool, list[bool] | None]:
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
            return start.plan, start.pinned, start.plan is None and start.cluster is None, \
                start.plan is None and start.profile is None, start.known_nodes

        found_plan, pinned, probe, profile, known_nodes = _on_rank0_then_broadcast(look_up, rank, group)
        if found_plan is not None:
            return found_plan, None if pinned else entry
        return _measure_and_plan(request, entry, found[0] if found else None, probe, profile, rank, phases,
                                 budget, timeout, group, known_nodes), entry


def _measure_and_plan(request: JobRequest, entry: Entry, start: replan.Start | None, probe: bool, profile: bool,
                      rank: int, phases: Phases, budget: float, timeout: timedelta,
                      group: dist.ProcessGroup | None, known_nodes: list[bool] | None = None) -> PlanRecord:
    """Collective: probe (every rank) and profile (rank 0) what the cache lacks, then plan on rank 0
    (`known_nodes`: the nodes a cached probe measured, whose pairs the probe skips)."""
    workload = request.workload
    on_gpu = torch.cuda.is_available() and not rehearsal_requested()
    probed = None
    if probe:
        from megatron_pipette.probe import run_probe

        probed = phases.run("probe", lambda: run_probe(
            budget_s=budget * PROBE_SHARE, precision=workload.precision if on_gpu else "fp32",
            small_bytes=4096, large_bytes=64 * MiB if on_gpu else MiB, repeats=3,
            timeout_s=timeout.total_seconds(), known_nodes=known_nodes))   # rank 0 only
    else:
        phases.skip("probe", "cached")

    def plan() -> PlanRecord:
        return _profile_and_plan(request, start, probed, entry, phases, on_gpu, budget)

    if not profile:
        phases.skip("profile", "cached")
        return _on_rank0_then_broadcast(plan, rank, group)
    from megatron.core import parallel_state

    # The profiler builds megatron-core modules, which need model-parallel state; set up a
    # neutral one (a collective) and tear it down before Megatron builds the real one.
    parallel_state.initialize_model_parallel(1, 1)
    try:
        return _on_rank0_then_broadcast(plan, rank, group)
    finally:
        parallel_state.destroy_model_parallel()


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


def _profile_and_plan(request: JobRequest, start: replan.Start, probed: ClusterFile | None, entry: Entry,
                      phases: Phases, on_gpu: bool, budget: float) -> PlanRecord:
    """Rank 0: the cluster (probed now, or cached), the layer profile (profiled now, or cached), the plan."""
    workload, constraints = request.workload, request.constraints
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
        from megatron_pipette.profile import profile_layers

        tp_sizes = [t for t in (1, 2, 4, 8) if cluster.gpus_per_node % t == 0
                    and workload.num_attention_heads % t == 0 and workload.query_groups % t == 0]
        if "tensor_model_parallel_size" in constraints:
            tp_sizes = [constraints["tensor_model_parallel_size"]]
        mbs = [m for m in PROFILE_MICRO_BATCHES if workload.global_batch_size % m == 0]
        # Each context-parallel size the search may try gets its shard timed (after everything else, so
        # a budget cut drops these first); megatron_args pins CP 1 where Transformer Engine is missing.
        cp_sizes = ([constraints["context_parallel_size"]] if "context_parallel_size" in constraints
                    else context_parallel_options(workload, cluster.world_size))
        profiled: ProfileFile = phases.run("profile", lambda: profile_layers(
            workload, tp_sizes=tp_sizes, micro_batch_sizes=mbs, device="cuda" if on_gpu else "cpu",
            budget_s=budget * PROFILE_SHARE, rank=0, cp_sizes=cp_sizes))
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


def auto_parallel(args: Any, argv: list[str], opts: Any) -> None:
    """Choose the layout and placement, re-rank the processes, and rewrite `args` (all ranks)."""
    try:    # the same verdict on every rank, before any of them waits for another
        options.check_options(opts)
    except PipetteError as e:
        raise SystemExit(f"auto-parallel: {e}") from None
    phases = Phases(budget_s=opts.auto_parallel_budget_s)
    supplied = []
    if rehearsal_requested():
        enable_cpu_rehearsal()
        supplied = dropin.cpu_rehearsal_settings(args, argv)
    dropin.use_prebuilt_dataset_helpers()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    backend = args.distributed_backend
    user_timeout = timedelta(minutes=args.distributed_timeout_minutes)
    # A dead peer must not hold the others for Megatron's long default timeout: no wait in the
    # pre-launch phase outlasts the whole budget by more than half.
    probe_timeout = timedelta(seconds=min(user_timeout.total_seconds(),
                                          max(MIN_WAIT_S, 1.5 * opts.auto_parallel_budget_s)))
    try:
        store, rank, world = init_from_torchrun_env(backend, probe_timeout, prefix=f"pipette/{attempt}/probe/")
    except dist.DistError as e:    # a rank did not join in time (hung or dead): nothing can start without it
        raise SystemExit(f"auto-parallel failed: not every rank joined within {probe_timeout.total_seconds():.0f} s "
                         f"(hung or dead): {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if supplied:
        log("CPU rehearsal: " + ", ".join(supplied), rank)
    fallback = megatron_args.layout_from_args(args, world)
    resume = None
    try:
        group = control_group(backend, probe_timeout)
        resume = _on_rank0_then_broadcast(lambda: checkpoint.find_resume(args), rank, group)
        chosen, record = _plan_on_rank0(args, argv, opts, rank, world, phases, probe_timeout, resume, group)
        layout, placement = chosen.best.layout, chosen.best.placement
        if placement.logical_to_physical.size != world:
            raise PipetteError(f"the plan is for {placement.logical_to_physical.size} processes, this job has {world}")
        status = f"ok:{chosen.best.digest()}"
    except Exception as e:  # any failure falls back (or stops) on every rank, together
        why = str(e) if isinstance(e, PipetteError) else f"{type(e).__name__}: {e}"
        kind = "stop" if isinstance(e, UnrunnableFlags) else "failed"
        chosen, status = None, f"{kind}:{why}".replace("\n", " ")[:1000]
    if phases.elapsed() > opts.auto_parallel_budget_s:
        status = f"failed:budget of {opts.auto_parallel_budget_s:g} s exceeded ({phases.elapsed():.0f} s)"
    # Peers stuck in a collective with a failed rank give up after probe_timeout; wait longer.
    statuses = _agree(store, f"pipette/{attempt}/status/", rank, world, status, 2 * probe_timeout)
    if len(set(statuses)) != 1 or not statuses[0].startswith("ok:"):
        reason, stop = failure_verdict(statuses)
        if stop:
            _close_quietly()
            raise SystemExit(f"auto-parallel failed: {reason}" + checkpoint.restarts_note())
        if resume is not None and (unkept := resume.rule.unkept(fallback)):
            _close_quietly()    # training on would only fail in Megatron's load_checkpoint
            raise SystemExit(f"auto-parallel failed: {reason}; the flags as given cannot resume the checkpoint in "
                             f"{resume.where}: {'; '.join(unkept)}" + checkpoint.restarts_note())
        if opts.auto_parallel_strict:
            _close_quietly()
            raise SystemExit(f"auto-parallel failed (--auto-parallel-strict): {reason}")
        left_open = ""
        if args.micro_batch_size is None:     # left to the planner; Megatron cannot start without one
            args.micro_batch_size = 1
            fallback, left_open = replace(fallback, micro_batch_size=1), " (--micro-batch-size, not given: 1)"
        log(f"WARNING: planning failed ({reason}); training with the flags as given{left_open}: "
            f"{fallback.describe()}", rank)
        layout, placement = None, None
    _rerank(store, placement, backend, user_timeout,
            f"pipette/{attempt}/train/", args, rank)
    if layout is not None:
        megatron_args.apply_layout(args, layout)
        _log_groups(layout, placement, args.rank)
        if getattr(args, "save", None) and not opts.auto_parallel_dry_run:
            checkpoint.record_plan_at_save(args, chosen, lambda: dist.get_rank() == 0)
        log(f"chosen layout {layout.describe()}: {' '.join(layout.megatron_args())}", args.rank)
        best = chosen.best
        margin = opts.auto_parallel_memory_headroom
        room = ("" if 100 * best.memory.headroom >= margin else f", under --auto-parallel-memory-headroom {margin:g}") \
            + (" (within the memory model's error: it may not fit)" if best.memory.tight else "")
        log(f"predicted {best.iteration_time_s:.4f} s/iteration, peak "
            f"{best.memory.peak_bytes / GiB:.2f} GiB of {best.memory.capacity_bytes / GiB:.2f} "
            f"GiB per device: {best.memory.headroom:.1%} free{room}", args.rank)
        if opts.auto_parallel_check_iterations > 0 and not opts.auto_parallel_dry_run:
            selfcheck.arm(selfcheck.CheckSetup(
                store=store, prefix=f"pipette/{attempt}/check/", iterations=opts.auto_parallel_check_iterations,
                plan=chosen, record=record, concludes=rank == 0,
                on_gpu=torch.cuda.is_available() and not rehearsal_requested()))
    if resume is not None:
        log(checkpoint.resume_line(resume, layout or fallback, args.load), args.rank)
    megatron_args.make_resumable_across_layouts(args)
    log("phases: " + phases.line(), args.rank)
    if opts.auto_parallel_dry_run:
        _close_quietly()
        sys.exit(0)


def _rerank(store, placement: Placement | None, backend: str, timeout: timedelta, prefix: str, args: Any,
            old_rank: int) -> None:
    """The training group: ranks from the placement, or torchrun's own after a failure (when the
    probe group may be broken, so it is dropped without a barrier)."""
    if placement is None:
        world = dist.get_world_size()
        _close_quietly()
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=old_rank, world_size=world,
                                timeout=timeout)
        new_rank = old_rank
    else:
        new_rank = reinit_with_ranks(store, placement.physical_to_logical.tolist(), backend, timeout, prefix)
    args.rank, args.world_size = new_rank, dist.get_world_size()
    if new_rank != old_rank:
        print(f"> auto-parallel: process {old_rank} (LOCAL_RANK {os.environ.get('LOCAL_RANK')}) "
              f"is now rank {new_rank}", flush=True)


def _log_groups(layout: Layout, placement: Placement, rank: int) -> None:
    """The groups Megatron will build, in torchrun's original ranks, so the re-ranking is visible."""
    sizes, physical = group_sizes(layout), placement.logical_to_physical.tolist()
    for kind, name in (("tp", "tensor"), ("cp", "context"), ("pp", "pipeline"), ("dp", "data"), ("ep", "expert")):
        if kind in ("cp", "ep") and sizes[kind] == 1:
            continue
        distinct = sorted(distinct_groups(physical, kind, **sizes))
        log(f"{name}-parallel groups (torchrun ranks): {' '.join(str(g) for g in distinct)}", rank)


def _close_quietly() -> None:
    if dist.is_initialized():
        # a broken group cannot be torn down cleanly; the process exits anyway
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

