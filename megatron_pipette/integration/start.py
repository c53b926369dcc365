"""The hook's start: every rank joins the pre-launch process group, with the CPU rehearsal's
switches set, before anything is decided (decide) or rewritten (apply). Kept apart so that what a
start is given (store, ranks, backend, timeouts, torchrun's attempt) is one typed value the other
two parts read, and tearing the group down is one function."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron_pipette.errors import PipetteError
from megatron_pipette.integration import dropin, options
from megatron_pipette.integration.common import Phases, exit_with, log
from megatron_pipette.integration.rehearsal import enable_cpu_rehearsal, rehearsal_requested
from megatron_pipette.integration.reinit import init_from_torchrun_env

MIN_WAIT_S = 30.0
"""Shortest timeout of a pre-launch wait (process start-up skew across nodes)."""


@dataclass(frozen=True)
class Started:
    """What every rank has once the pre-launch group is up."""

    store: dist.Store
    rank: int
    """torchrun's rank (the placement may give this process another: apply)."""
    world: int
    backend: str
    """--distributed-backend, which the probe measures and the training group uses."""
    timeout: timedelta
    """The pre-launch waits' timeout: Megatron's, cut so that a dead peer cannot hold the others."""
    user_timeout: timedelta
    """--distributed-timeout-minutes, for the training group."""
    attempt: str
    """torchrun's restart count: the store keys of each attempt are its own."""
    phases: Phases
    """The pre-launch phases' clock, started before the rehearsal and the group."""

    def prefix(self, part: str) -> str:
        """The store prefix of one part of this attempt ("probe", "status", "train", "check")."""
        return f"pipette/{self.attempt}/{part}/"


def start(args: Any, argv: list[str], opts: Any) -> Started:
    """Check the in-job options (the same verdict on every rank, before any of them waits for another),
    set the CPU rehearsal's switches, and join the pre-launch group (all ranks)."""
    try:
        options.check_options(opts)
    except PipetteError as e:
        exit_with(f"auto-parallel: {e}")
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
    timeout = timedelta(seconds=min(user_timeout.total_seconds(), max(MIN_WAIT_S, 1.5 * opts.auto_parallel_budget_s)))
    try:
        store, rank, world = init_from_torchrun_env(backend, timeout, prefix=f"pipette/{attempt}/probe/")
    except dist.DistError as e:    # a rank did not join in time (hung or dead): nothing can start without it
        exit_with(f"auto-parallel failed: not every rank joined within {timeout.total_seconds():.0f} s "
                  f"(hung or dead): {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    if supplied:
        log("CPU rehearsal: " + ", ".join(supplied), rank)
    return Started(store=store, rank=rank, world=world, backend=backend, timeout=timeout, user_timeout=user_timeout,
                   attempt=attempt, phases=phases)


def control_group(backend: str, timeout: timedelta) -> dist.ProcessGroup | None:
    """The group the pre-launch phase exchanges its plan and identities in: gloo, whose collectives
    raise when a peer stops answering within `timeout`, where NCCL's watchdog would instead tear the
    process down with a traceback; None (the default group) when that already is gloo. The probe
    still measures on the job's own backend."""
    return None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)


def close_quietly() -> None:
    if dist.is_initialized():
        # a broken group cannot be torn down cleanly; the process exits anyway
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
