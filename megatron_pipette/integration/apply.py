"""The hook's last part: put the decided `StartPlan` into effect on every rank. Re-rank the processes
by its placement, rewrite Megatron's layout arguments, log the groups, record the plan with each
checkpoint saved, and arm the self-check; or, after the agreed fallback, train on torchrun's ranks with
the flags as given. Kept apart so that nothing here decides: it only applies what decide returned."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_pipette.integration import checkpoint, megatron_args, selfcheck
from megatron_pipette.integration.common import log
from megatron_pipette.integration.decide import StartPlan
from megatron_pipette.integration.groups import distinct_groups, group_sizes
from megatron_pipette.integration.rehearsal import rehearsal_requested
from megatron_pipette.integration.reinit import reinit_with_ranks
from megatron_pipette.integration.start import Started, close_quietly
from megatron_pipette.plan.placement import Placement
from megatron_pipette.spec.layout import Layout
from megatron_pipette.units import GiB


def apply(started: Started, decided: StartPlan, args: Any, opts: Any) -> None:
    """Re-rank, rewrite `args`, arm the self-check (all ranks); exit 0 after a dry run."""
    chosen = decided.plan
    layout = None if chosen is None else chosen.best.layout
    placement = None if chosen is None else chosen.best.placement
    if chosen is None and args.micro_batch_size is None:    # the fallback's, which the warning named
        args.micro_batch_size = decided.fallback.micro_batch_size
    _rerank(started.store, placement, started.backend, started.user_timeout, started.prefix("train"), args,
            started.rank)
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
                store=started.store, prefix=started.prefix("check"), iterations=opts.auto_parallel_check_iterations,
                plan=chosen, record=decided.entry, concludes=started.rank == 0,
                on_gpu=torch.cuda.is_available() and not rehearsal_requested()))
    if decided.resume is not None:
        log(checkpoint.resume_line(decided.resume, layout or decided.fallback, args.load), args.rank)
    megatron_args.make_resumable_across_layouts(args)
    log("phases: " + started.phases.line(), args.rank)
    if opts.auto_parallel_dry_run:
        close_quietly()
        sys.exit(0)


def _rerank(store, placement: Placement | None, backend: str, timeout: timedelta, prefix: str, args: Any,
            old_rank: int) -> None:
    """The training group: ranks from the placement, or torchrun's own after a failure (when the
    probe group may be broken, so it is dropped without a barrier)."""
    if placement is None:
        world = dist.get_world_size()
        close_quietly()
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
