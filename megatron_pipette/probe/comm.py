"""Point-to-point helpers of the torch transport: timed one-way messages and exchanges.

Why: every point-to-point wait carries a timeout so that a dead or stuck partner
ends the probe with an error instead of a hang; and on NCCL every message goes
through `batch_isend_irecv`, which runs on the group's own communicator, where a
single `send`/`recv` would create a two-rank communicator for each new pair
(torch's ProcessGroupNCCL keys unbatched point-to-point by the rank pair): a
tournament would then set up a communicator per partner, each a store round trip
and an NCCL initialisation that nothing bounds.
"""

from __future__ import annotations

import time
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


def _post(ops: list[tuple], group: dist.ProcessGroup | None, device: torch.device) -> list[dist.Work]:
    """Start (op, tensor, peer) point-to-point operations together: one batch on NCCL."""
    if device.type == "cuda":
        return dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group) for op, tensor, peer in ops])
    return [op(tensor, peer, group) for op, tensor, peer in ops]


def _wait(works: list[dist.Work], device: torch.device, timeout: timedelta) -> None:
    for work in works:
        if device.type == "cuda":
            work.wait()      # NCCL's own timeout (the group's) ends a stuck wait
        else:
            work.wait(timeout)


def one_way(group: dist.ProcessGroup | None, device: torch.device, peer: int, data: torch.Tensor,
            ack: torch.Tensor, sending: bool, timeout: timedelta) -> float:
    """One message to `peer` (global rank; sending) or from it, answered by a one-byte
    acknowledgement; seconds on this rank. The sender's time is the message's one-way time plus
    the small reply's, with nothing travelling the other way while the message does (so the
    message and the reply are two batches, one after the other)."""
    start = time.perf_counter()
    steps = [(dist.isend, data), (dist.irecv, ack)] if sending else [(dist.irecv, data), (dist.isend, ack)]
    for op, tensor in steps:
        _wait(_post([(op, tensor, peer)], group, device), device, timeout)
    synchronize(device)
    return time.perf_counter() - start


def exchange(group: dist.ProcessGroup | None, device: torch.device, me: int, peer: int,
             send: torch.Tensor, recv: torch.Tensor, timeout: timedelta) -> float:
    """One concurrent bidirectional exchange with `peer` (global ranks); seconds on this rank.

    The lower rank posts its send first and the higher its receive first, so even a backend
    whose sends block until matched cannot deadlock.
    """
    start = time.perf_counter()
    ops = [(dist.isend, send, peer), (dist.irecv, recv, peer)]
    _wait(_post(ops if me < peer else ops[::-1], group, device), device, timeout)
    synchronize(device)
    return time.perf_counter() - start


def batched_exchanges(group: dist.ProcessGroup | None, device: torch.device, peer: int, send: torch.Tensor,
                      recv: torch.Tensor, count: int, timeout: timedelta) -> float:
    """`count` exchanges with `peer` (global rank) back to back, as 1F1B's steady state runs them
    on a pipeline hop; seconds per exchange on this rank.

    Posted as megatron-core posts them without interleaving (p2p_communication._batched_p2p_ops:
    one batch, the send before the receive on both sides). On gloo a send posted first can hold
    back the receive behind it where this rank's link is the slower, so such an exchange takes
    one or two message times by turns; the train's mean is what a pipeline pays per exchange.
    """
    start = time.perf_counter()
    for _ in range(count):
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer, group),
                                        dist.P2POp(dist.irecv, recv, peer, group)])
        _wait(works, device, timeout)
    synchronize(device)
    return (time.perf_counter() - start) / count


def all_to_all(group: dist.ProcessGroup | None, device: torch.device, peers: list[int], send: torch.Tensor,
               recv: torch.Tensor, timeout: timedelta) -> float:
    """Row k of `send` to peers[k] (global ranks) and row k of `recv` from it, all at once: one
    batch on NCCL, as its all-to-all runs; seconds on this rank. Every receive is posted before any
    send, so a backend whose sends block until matched cannot deadlock."""
    start = time.perf_counter()
    ops = [(dist.irecv, recv[k], peer) for k, peer in enumerate(peers)] + \
          [(dist.isend, send[k], peer) for k, peer in enumerate(peers)]
    _wait(_post(ops, group, device), device, timeout)
    synchronize(device)
    return time.perf_counter() - start
