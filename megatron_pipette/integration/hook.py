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

In three parts: `start` (0-1), `decide` (2-3: one StartPlan, the same on every
rank, or the agreed fallback) and `apply` (4-5).
"""

from __future__ import annotations

from typing import Any

from megatron_pipette.integration.apply import apply
from megatron_pipette.integration.decide import decide
from megatron_pipette.integration.start import start


def auto_parallel(args: Any, argv: list[str], opts: Any) -> None:
    """Choose the layout and placement, re-rank the processes, and rewrite `args` (all ranks)."""
    started = start(args, argv, opts)
    apply(started, decide(started, args, argv, opts), args, opts)
