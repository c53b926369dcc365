"""What `profile_layers` may be asked, checked without torch.

Why separate: `pipette profile` refuses a bad flag before it pays for importing torch and
megatron-core (seconds), as the probe's options do; profile_layers applies the same check
when called in-job.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.layout import RECOMPUTE_GRANULARITIES
from megatron_pipette.spec.workload import MAX_SIZES, Workload

MAX_ITERATIONS = 1000
"""Untimed or timed iterations per shape: the median settles long before."""
MAX_BUDGET_S = 7 * 86400.0
MAX_MICRO_BATCH_SIZE = MAX_SIZES["global_batch_size"]
MAX_RANK = 1 << 24
"""Ranks of the largest cluster the planner reads (16384 nodes of 1024)."""


def check_tensor_parallel_sizes(workload: Workload, tp_sizes: Sequence[int]) -> None:
    for tp in tp_sizes:
        if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
            raise PipetteError(f"--tp must be positive integers, got {tp!r}")
        for flag, value in (("--num-attention-heads", workload.num_attention_heads),
                            ("--num-query-groups", workload.query_groups),
                            ("--ffn-hidden-size", workload.ffn)):
            if value % tp:
                raise PipetteError(f"--tp {tp}: {flag} {value} is not divisible by it")


def check_request(workload: Workload, tp_sizes: Sequence[int], micro_batch_sizes: Sequence[int],
                  recompute: Sequence[str | None], sequence_parallel: Sequence[bool], budget_s: float,
                  warmup: int, iters: int, cp_sizes: Sequence[int], rank: int | None = None) -> None:
    """Raise PipetteError naming the flag for anything profile_layers cannot measure."""
    if not tp_sizes:
        raise PipetteError("--tp needs at least one tensor-parallel size")
    check_tensor_parallel_sizes(workload, tp_sizes)
    if not micro_batch_sizes or any(not isinstance(m, int) or isinstance(m, bool) or not 0 < m <= MAX_MICRO_BATCH_SIZE
                                    for m in micro_batch_sizes):
        raise PipetteError(f"--mbs must be positive integers up to {MAX_MICRO_BATCH_SIZE}, "
                           f"got {list(micro_batch_sizes)!r}")
    bad = [r for r in recompute if r not in RECOMPUTE_GRANULARITIES]
    if not recompute or bad:
        raise PipetteError(f"--recompute must be among none, selective, full; got {list(recompute)!r}")
    if not sequence_parallel or any(not isinstance(s, bool) for s in sequence_parallel):
        raise PipetteError(f"sequence_parallel must be a non-empty list of booleans, got {sequence_parallel!r}")
    if False not in sequence_parallel and all(t == 1 for t in tp_sizes):
        raise PipetteError("--sequence-parallel needs a --tp size > 1")
    bad_cp = [c for c in cp_sizes if not isinstance(c, int) or c <= 0 or (c > 1 and workload.seq_length % (2 * c))]
    if bad_cp:
        raise PipetteError(f"--cp sizes must divide --seq-length {workload.seq_length} into 2 x CP chunks, "
                           f"got {bad_cp}")
    if not (isinstance(budget_s, int | float) and math.isfinite(budget_s) and 0 < budget_s <= MAX_BUDGET_S):
        raise PipetteError(f"--budget-s must be positive, at most {MAX_BUDGET_S:.0f} seconds, got {budget_s!r}")
    if not (isinstance(warmup, int) and 0 <= warmup <= MAX_ITERATIONS and isinstance(iters, int)
            and 1 <= iters <= MAX_ITERATIONS):
        raise PipetteError(f"--warmup must be in 0..{MAX_ITERATIONS} and --iters in 1..{MAX_ITERATIONS}, "
                           f"got {warmup} and {iters}")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < MAX_RANK):
        raise PipetteError(f"--rank must be an integer from 0 to {MAX_RANK - 1}, got {rank!r}")
