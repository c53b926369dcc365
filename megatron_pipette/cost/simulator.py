"""An event-driven simulator of megatron-core's pipeline schedules.

It executes, per pipeline rank, the exact sequence of compute steps and p2p
calls that megatron-core 0.19 issues (`schedules.py`) and times it with
rendezvous semantics: a transfer starts when both its sender and its receiver
have posted it and lasts its alpha-beta time on that hop; a blocking call
returns when all its transfers have ended; an asynchronous post returns at once
and a later wait blocks until the transfer has ended. Compute and transfers do
not slow each other down, and NCCL's in-stream ordering of separate
isend/irecv calls is not modelled (docs/time-model.md).

It is the reference for the closed forms in `cost.schedules` (tests) and the
planner's re-check of its best candidates. A schedule that would hang raises
AssertionError naming the blocked ranks.

Programs are per rank lists of ops:
  (COMPUTE, kind, chunk, microbatch)   kind 0 = forward, 1 = backward
  (POST, ((key, is_sender), ...))      post transfers, do not wait
  (WAIT, (key, ...))                   block until these transfers have ended
A transfer key is (src, dst, direction, n): the n-th message on that channel.
Forward messages go from rank r to (r+1) % p on hop r; backward messages go
from (r+1) % p to r on hop r.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

COMPUTE, POST, WAIT = 0, 1, 2
FORWARD, BACKWARD = 0, 1


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Timings of one simulated iteration's forward-backward pass."""

    total_s: float
    """When the last rank finished its last op."""
    finish_s: np.ndarray
    """(p,) when each rank finished its last backward (its DP reduction may start then)."""
    end_s: np.ndarray
    """(p,) when each rank finished its last op (sends included)."""
    trace: tuple | None = None
    """(rank, kind, chunk, microbatch, start, end) per compute op, when asked for."""


class _Builder:
    """Builds one rank's program, numbering messages per channel as NCCL matches them."""

    def __init__(self, rank: int, p: int, counters: dict):
        self.rank, self.p, self.ops, self.counters = rank, p, [], counters

    def _key(self, peer: int, direction: int, send: bool) -> tuple:
        src, dst = (self.rank, peer) if send else (peer, self.rank)
        channel = (src, dst, direction, send)
        n = self.counters.get(channel, 0)
        self.counters[channel] = n + 1
        return (src, dst, direction, n)

    def endpoints(self, send_next=False, recv_prev=False, send_prev=False, recv_next=False) -> dict:
        nxt, prv = (self.rank + 1) % self.p, (self.rank - 1) % self.p
        out = {}
        if send_next:
            out["send_next"] = (self._key(nxt, FORWARD, True), True)
        if recv_prev:
            out["recv_prev"] = (self._key(prv, FORWARD, False), False)
        if send_prev:
            out["send_prev"] = (self._key(prv, BACKWARD, True), True)
        if recv_next:
            out["recv_next"] = (self._key(nxt, BACKWARD, False), False)
        return out

    def post(self, **which) -> dict:
        ends = self.endpoints(**which)
        if ends:
            self.ops.append((POST, tuple(ends.values())))
        return {name: end[0] for name, end in ends.items()}

    def call(self, **which) -> None:
        """A blocking p2p call: post everything, wait for everything."""
        keys = self.post(**which)
        if keys:
            self.ops.append((WAIT, tuple(keys.values())))

    def wait(self, key) -> None:
        self.ops.append((WAIT, (key,)))

    def compute(self, kind: int, chunk: int, microbatch: int) -> None:
        self.ops.append((COMPUTE, kind, chunk, microbatch))


def _finish(builders: list[_Builder]) -> tuple:
    counts = builders[0].counters
    for (src, dst, direction, send), n in counts.items():
        assert counts.get((src, dst, direction, not send), 0) == n, \
            f"unmatched p2p messages on {src}->{dst} ({'fwd' if direction == FORWARD else 'bwd'})"
    return tuple(tuple(b.ops) for b in builders)


@lru_cache(maxsize=256)
def program_1f1b(p: int, m: int) -> tuple:
    """forward_backward_pipelining_without_interleaving, batched blocking p2p (Megatron's default)."""
    counters: dict = {}
    builders = [_Builder(r, p, counters) for r in range(p)]
    for r, rb in enumerate(builders):
        first, last = r == 0, r == p - 1
        warmup = min(p - r - 1, m)
        remaining = m - warmup
        for i in range(warmup):
            rb.call(recv_prev=not first)
            rb.compute(FORWARD, 0, i)
            rb.call(send_next=not last)
        if remaining:
            rb.call(recv_prev=not first)
        for i in range(remaining):
            rb.compute(FORWARD, 0, warmup + i)
            rb.call(send_next=not last, recv_next=not last)       # send_forward_recv_backward
            rb.compute(BACKWARD, 0, i)
            if i == remaining - 1:
                rb.call(send_prev=not first)                        # send_backward
            else:
                rb.call(send_prev=not first, recv_prev=not first)   # send_backward_recv_forward
        for i in range(warmup):
            rb.call(recv_next=not last)
            rb.compute(BACKWARD, 0, remaining + i)
            rb.call(send_prev=not first)
    return _finish(builders)


def schedule_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """megatron-core's get_schedule_table: (microbatch, chunk) per virtual microbatch."""
    table = []
    for lo in range(0, m, group):
        hi = m if lo + group >= m else lo + group
        table += [(mb, c) for c in range(v) for mb in range(lo, hi)]
    return table


def interleaved_warmup(p: int, r: int, m: int, v: int, group: int) -> int:
    """Warmup forward steps of pipeline rank r (get_pp_rank_microbatches)."""
    return min((p - r - 1) * 2 + (v - 1) * group, m * v)


@lru_cache(maxsize=256)
def program_interleaved(p: int, m: int, v: int, overlap_p2p_comm: bool = True) -> tuple:
    """forward_backward_pipelining_with_interleaving with Megatron-LM's defaults.

    Megatron-LM turns overlap_p2p_comm on for the interleaved schedule (and
    batch_p2p_comm off), sets deallocate_pipeline_outputs and leaves
    overlap_p2p_comm_warmup_flush off and microbatch_group_size_per_vp_stage = PP.
    """
    assert v >= 2 and p >= 2 and m % p == 0, "interleaving needs PP >= 2, >= 2 chunks and M % PP == 0"
    assert overlap_p2p_comm or p > 2, "Megatron needs PP > 2 without p2p overlap"
    counters: dict = {}
    builders = [_Builder(r, p, counters) for r in range(p)]
    table = schedule_table(m, v, p)
    for r, rb in enumerate(builders):
        _interleaved_rank(rb, r, p, m, v, table, overlap_p2p_comm)
    return _finish(builders)


def _interleaved_rank(rb: _Builder, r: int, p: int, m: int, v: int, table, overlap: bool) -> None:
    first, last = r == 0, r == p - 1
    total = m * v
    warmup = interleaved_warmup(p, r, m, v, p)
    all_warmup = warmup >= total
    remaining = total - warmup

    def chunk(k: int, forward: bool) -> int:
        c = table[k % total][1]
        return c if forward else v - 1 - c

    def recv_from_previous(k: int, forward: bool) -> bool:
        """recv_tensor_from_previous_stage: does a tensor arrive for step k+1?"""
        leading = first if forward else last
        if not leading:
            return True
        if k < p - 1:
            return False
        return chunk(k - (p - 1), forward) != ((v - 1) if forward else 0)

    def fwd(k: int) -> bool:
        """Compute forward step k; return whether its output goes downstream."""
        c = chunk(k, True)
        rb.compute(FORWARD, c, table[k][0])
        return not (c == v - 1 and last)

    def bwd(k: int) -> bool:
        c = chunk(k, False)
        rb.compute(BACKWARD, c, table[k][0])  # backward k runs the oldest forward of chunk c
        return not (c == 0 and first)

    rb.call(recv_prev=not first)
    recv_prev_q, recv_next_q = [], []
    send_next_h = send_prev_h = None
    for k in range(warmup):
        recv_prev = recv_from_previous(k, True) and k != total - 1
        send = fwd(k)
        if k == warmup - 1 and not overlap and not all_warmup:
            rb.call(send_next=send, recv_prev=recv_prev, recv_next=not last)
        else:
            rb.call(send_next=send, recv_prev=recv_prev)
        if overlap and k == warmup - 1 and not all_warmup and not last:
            recv_next_q.append(rb.post(recv_next=True)["recv_next"])
    for k in range(remaining):
        fk = k + warmup
        if overlap:
            if not (chunk(fk, True) == 0 and first) and recv_prev_q:
                rb.wait(recv_prev_q.pop(0))
            send = fwd(fk)
            recv_prev = recv_from_previous(fk, True) and k != remaining - 1
            keys = rb.post(send_next=send, recv_prev=recv_prev)
            if send_next_h is not None:
                rb.wait(send_next_h)
            send_next_h = keys.get("send_next")
            if recv_prev:
                recv_prev_q.append(keys["recv_prev"])
            if send_next_h is not None:  # deallocate_pipeline_outputs: wait for the send at once
                rb.wait(send_next_h)
                send_next_h = None
            if not (chunk(k, False) == v - 1 and last) and recv_next_q:
                rb.wait(recv_next_q.pop(0))
            send = bwd(k)
            recv_next = recv_from_previous(k, False)
            keys = rb.post(send_prev=send, recv_next=recv_next)
            if send_prev_h is not None:
                rb.wait(send_prev_h)
            send_prev_h = keys.get("send_prev")
            if recv_next:
                recv_next_q.append(keys["recv_next"])
        else:
            send_f = fwd(fk)
            send_b = bwd(k)
            recv_prev = recv_from_previous(fk, True) and k != remaining - 1
            recv_next = recv_from_previous(k, False)
            rb.call(send_next=send_f, send_prev=send_b, recv_prev=recv_prev, recv_next=recv_next)
    if all_warmup:
        rb.call(recv_next=not last)
    for k in range(remaining, total):
        if not (chunk(k, False) == v - 1 and last) and k != 0 and recv_next_q:
            rb.wait(recv_next_q.pop(0))
        recv_next = recv_from_previous(k, False) and k != total - 1
        send = bwd(k)
        rb.call(send_prev=send, recv_next=recv_next)
    if send_prev_h is not None:
        rb.wait(send_prev_h)
    assert not recv_prev_q and not recv_next_q, f"rank {r}: receives left pending"


def simulate(program: tuple, forward_s: np.ndarray, backward_s: np.ndarray, fwd_comm_s: np.ndarray,
             bwd_comm_s: np.ndarray, *, trace: bool = False) -> SimResult:
    """Time a program.

    forward_s, backward_s: (p, v) compute time of one micro-batch of each model chunk on each rank.
    fwd_comm_s[h], bwd_comm_s[h]: one activation (gradient) message on hop h, from rank h to
    (h+1) % p (and back).
    """
    p = len(program)
    fwd = np.asarray(forward_s, dtype=float).reshape(p, -1).tolist()
    bwd = np.asarray(backward_s, dtype=float).reshape(p, -1).tolist()
    comm = (np.asarray(fwd_comm_s, dtype=float).tolist(), np.asarray(bwd_comm_s, dtype=float).tolist())
    clock, pc = [0.0] * p, [0] * p
    last_bwd = [0.0] * p
    posted: dict = {}      # key -> post time of the first side to post
    done: dict = {}        # key -> end time, once both sides posted
    waiting: dict = {}     # key -> ranks blocked on it
    events = [] if trace else None
    runnable = list(range(p))
    while runnable:
        r = runnable.pop()
        ops, t, i = program[r], clock[r], pc[r]
        while i < len(ops):
            op = ops[i]
            if op[0] == COMPUTE:
                kind, c = op[1], op[2]
                d = fwd[r][c] if kind == FORWARD else bwd[r][c]
                if events is not None:
                    events.append((r, kind, c, op[3], t, t + d))
                t += d
                if kind == BACKWARD:
                    last_bwd[r] = t
            elif op[0] == POST:
                for key, _ in op[1]:
                    other = posted.pop(key, None)
                    if other is None:
                        posted[key] = t
                        continue
                    src, dst, direction, _ = key
                    hop = src if direction == FORWARD else dst
                    done[key] = max(t, other) + comm[direction][hop]
                    for blocked in waiting.pop(key, ()):
                        runnable.append(blocked)
            else:
                pending = next((k for k in op[1] if k not in done), None)
                if pending is not None:
                    waiting.setdefault(pending, []).append(r)
                    break
                t = max(t, *(done[k] for k in op[1]))
            i += 1
        clock[r], pc[r] = t, i
    stuck = [r for r in range(p) if pc[r] < len(program[r])]
    assert not stuck, f"pipeline schedule deadlocks: ranks {stuck} blocked at ops {[pc[r] for r in stuck]}"
    return SimResult(total_s=max(clock), finish_s=np.array(last_bwd), end_s=np.array(clock),
                     trace=tuple(events) if trace else None)
