"""Small communication helpers shared by the probe stages.

Why: every budget decision must be identical on all ranks, so each stage
agrees on its inputs with one all-reduce MAX that doubles as the round
barrier; and every point-to-point wait carries a timeout so that a dead or
stuck partner ends the probe with an error instead of a hang.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class Clock:
    """Seconds since the probe's first barrier, on this rank."""

    t0: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def device_of(group: dist.ProcessGroup | None) -> torch.device:
    """The device the group's backend communicates from: the current CUDA device for NCCL, else CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agree_max(group: dist.ProcessGroup | None, device: torch.device, values: Sequence[float]) -> list[float]:
    """Element-wise maximum of `values` over all ranks; also a barrier.

    Returns on every rank only after every rank contributed, and the host
    waits for the result (tolist), so it synchronises the ranks like
    dist.barrier while carrying the figures the next decision needs.
    """
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def one_way(group: dist.ProcessGroup | None, device: torch.device, peer: int, data: torch.Tensor,
            ack: torch.Tensor, sending: bool, timeout: timedelta) -> float:
    """One message to `peer` (sending) or from it, answered by a one-byte acknowledgement;
    seconds on this rank. The sender's time is the message's one-way time plus the small
    reply's, with nothing travelling the other way while the message does."""
    peer_global = dist.get_global_rank(group, peer) if group is not None else peer
    start = time.perf_counter()
    if sending:
        ops = [(dist.isend, data), (dist.irecv, ack)]
    else:
        ops = [(dist.irecv, data), (dist.isend, ack)]
    for op, tensor in ops:
        _wait(op(tensor, peer_global, group), device, timeout)
    synchronize(device)
    return time.perf_counter() - start


def _wait(work: dist.Work, device: torch.device, timeout: timedelta) -> None:
    if device.type == "cuda":
        work.wait()
    else:
        work.wait(timeout)


def exchange(group: dist.ProcessGroup | None, device: torch.device, me: int, peer: int,
             send: torch.Tensor, recv: torch.Tensor, timeout: timedelta) -> float:
    """One concurrent bidirectional exchange with `peer` (group ranks); returns seconds on this rank.

    The lower rank posts its send first and the higher its receive first, so
    even a backend whose sends block until matched cannot deadlock. On NCCL
    both operations go in one batch (one fused group call).
    """
    peer_global = dist.get_global_rank(group, peer) if group is not None else peer
    start = time.perf_counter()
    if device.type == "cuda":
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer_global, group),
                                        dist.P2POp(dist.irecv, recv, peer_global, group)])
    elif me < peer:
        works = [dist.isend(send, peer_global, group), dist.irecv(recv, peer_global, group)]
    else:
        works = [dist.irecv(recv, peer_global, group), dist.isend(send, peer_global, group)]
    for w in works:
        _wait(w, device, timeout)
    synchronize(device)
    return time.perf_counter() - start
