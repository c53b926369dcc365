"""All-reduce timings on the candidate tensor-parallel groups inside each node.

Why: tensor parallelism all-reduces activations inside a node several times
per layer; the measured time for each candidate group size (consecutive
ranks, as Megatron forms TP groups) tells the planner what TP costs here,
including topology effects a pairwise matrix misses (NVSwitch vs PCIe
rings). All nodes' groups of one size run at once, like in training.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_pipette.probe.budget import SAFETY, affordable_repeats
from megatron_pipette.probe.comm import Clock, agree_max, synchronize


def candidate_tp_sizes(gpus_per_node: int, requested: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """(sizes to measure, requested sizes rejected): sizes >= 2 that divide gpus_per_node."""
    if requested is None:
        return [s for s in range(2, gpus_per_node + 1) if gpus_per_node % s == 0], []
    sizes = sorted(set(int(s) for s in requested))
    good = [s for s in sizes if s >= 2 and gpus_per_node % s == 0]
    return good, [s for s in sizes if s not in good]


def tp_group_ranks(rank: int, size: int, gpus_per_node: int) -> list[int]:
    """The consecutive-rank TP group of `size` that `rank` belongs to (group ranks)."""
    node_start = rank - rank % gpus_per_node
    start = node_start + (rank % gpus_per_node) // size * size
    return list(range(start, start + size))


def measure_tp_allreduce(group: dist.ProcessGroup | None, device: torch.device, clock: Clock, *,
                         gpus_per_node: int, sizes: Sequence[int], nbytes: int, repeats: int,
                         deadline_s: float, timeout: timedelta) -> tuple[list[dict], list[dict]]:
    """This rank's all-reduce records and the sizes skipped for the budget (identical on all ranks).

    Each size: a subgroup per TP block (only members synchronise its
    creation), one warm-up all-reduce that also prices the repeats, then the
    timed repeats; the record's time is this rank's median (rank 0 keeps the
    slowest member's).
    """
    me = dist.get_rank(group)
    records: list[dict] = []
    skipped: list[dict] = []
    numel = max(1, nbytes // 4)
    data = torch.zeros(numel, dtype=torch.float32, device=device)
    last_cost = 0.0   # the previous size's cost estimates the next one's
    for i, size in enumerate(sizes):
        (now,) = agree_max(group, device, [clock.elapsed()])
        if now + SAFETY * last_cost >= deadline_s:
            for s in sizes[i:]:
                skipped.append({"what": "collectives", "tp_size": s,
                                "reason": f"budget: all-reduce over TP groups of {s} not timed"})
            break
        ranks = tp_group_ranks(me, size, gpus_per_node)
        members = [dist.get_global_rank(group, r) for r in ranks] if group is not None else ranks
        sub = dist.new_group(members, timeout=timeout, use_local_synchronization=True)
        try:
            warm = _timed_all_reduce(data, sub, device)
            started, (now, warm) = now, agree_max(group, device, [clock.elapsed(), warm])
            count = affordable_repeats(warm, time_left_s=deadline_s - now, max_repeats=repeats)
            last_cost = now - started + count * warm
            times = [_timed_all_reduce(data, sub, device) for _ in range(count)] or [warm]
            records.append({"op": "all_reduce", "ranks": ranks, "bytes": numel * 4,
                            "time_s": statistics.median(times)})
        finally:
            dist.destroy_process_group(sub)
    return records, skipped


def _timed_all_reduce(data: torch.Tensor, sub: dist.ProcessGroup, device: torch.device) -> float:
    start = time.perf_counter()
    dist.all_reduce(data, group=sub)
    synchronize(device)
    return time.perf_counter() - start
