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
  (POST, ((key, is_sender, paired), ...))
                                       post transfers, do not wait; `paired`: the call also
                                       carries the reverse message on the same hop (an exchange)
  (WAIT, (key, ...))                   block until these transfers have ended
A transfer key is (src, dst, direction, n): the n-th message on that channel.
Forward messages go from rank r to (r+1) % p on hop r; backward messages go
from (r+1) % p to r on hop r. A message both sides post as part of an exchange
(1F1B's send_forward_recv_backward meeting send_backward_recv_forward) runs at
the hop's two-way rate, since the reverse message shares the link with it.

With `trace`, an unbatched run also returns every rank's timeline as Events (for pictures): its
passes, and each interval it spent blocked in a p2p call, split where the message it waited for
(the last to arrive, when it waited for several) started moving (before: waiting on its peer, the
pipeline's bubble; after: the transfer itself, exposed communication).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, reduce

import numpy as np

COMPUTE, POST, WAIT = 0, 1, 2
FORWARD, BACKWARD = 0, 1


@dataclass(frozen=True, kw_only=True)
class Event:
    """One interval of one rank's timeline."""

    rank: int
    what: str
    """"forward", "backward" (a pass), "wait" (blocked before the awaited message started moving),
    "p2p" (blocked while it moved)."""
    start_s: float
    end_s: float
    chunk: int | None = None
    """Model chunk of a pass."""
    microbatch: int | None = None
    """Micro-batch of a pass."""


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Timings of one simulated iteration's forward-backward pass."""

    total_s: float | np.ndarray
    """When the last rank finished its last op ((B,) with a batch)."""
    finish_s: np.ndarray
    """(p,) when each rank finished its last backward (its DP reduction may start then); (B, p)."""
    end_s: np.ndarray
    """(p,) when each rank finished its last op (sends included); (B, p)."""
    events: tuple[Event, ...] = ()
    """With `trace`: every rank's passes and blocked intervals, in the order each rank ran them."""


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
        pairs = (("send_next", "recv_next"), ("send_prev", "recv_prev"))     # same hop, both directions
        paired = {name for pair in pairs if all(n in ends for n in pair) for name in pair}
        if ends:
            self.ops.append((POST, tuple((key, sender, name in paired) for name, (key, sender) in ends.items())))
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


# Module-level memo (cost.model lists them): the program depends on (p, m) alone.
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
    """Warmup forward steps of pipeline rank r before its first backward (get_pp_rank_microbatches,
    forward_only False): p-r-1 without interleaving (v = 1), else (p-r-1)*2 + (v-1)*group; at most m*v."""
    if v == 1:
        return min(p - r - 1, m)
    return min((p - r - 1) * 2 + (v - 1) * group, m * v)


def forward_chunks(m: int, v: int, group: int) -> list[int]:
    """Model chunk of each forward step, in order: the chunk column of schedule_table."""
    return [c for _, c in schedule_table(m, v, group)]


# Module-level memo (cost.model lists them): the program depends on its arguments alone.
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
        _InterleavedRank(rb, r, p, m, v, table, overlap_p2p_comm).run()
    return _finish(builders)


class _InterleavedRank:
    """One pipeline rank's calls in forward_backward_pipelining_with_interleaving, in its order."""

    def __init__(self, rb: _Builder, r: int, p: int, m: int, v: int, table, overlap: bool):
        self.rb, self.p, self.v, self.table, self.overlap = rb, p, v, table, overlap
        self.first, self.last, self.total = r == 0, r == p - 1, m * v
        self.warmup = interleaved_warmup(p, r, m, v, p)
        self.all_warmup = self.warmup >= self.total
        self.remaining = self.total - self.warmup
        self.recv_prev_q, self.recv_next_q = [], []
        self.send_next_h = self.send_prev_h = None

    def chunk(self, k: int, forward: bool) -> int:
        c = self.table[k % self.total][1]
        return c if forward else self.v - 1 - c

    def recv_from_previous(self, k: int, forward: bool) -> bool:
        """recv_tensor_from_previous_stage: does a tensor arrive for step k+1?"""
        if not (self.first if forward else self.last):
            return True
        if k < self.p - 1:
            return False
        return self.chunk(k - (self.p - 1), forward) != ((self.v - 1) if forward else 0)

    def fwd(self, k: int) -> bool:
        """Forward step k; True when its output goes downstream."""
        c = self.chunk(k, True)
        self.rb.compute(FORWARD, c, self.table[k][0])
        return not (c == self.v - 1 and self.last)

    def bwd(self, k: int) -> bool:
        c = self.chunk(k, False)
        self.rb.compute(BACKWARD, c, self.table[k][0])   # backward k runs the oldest forward of chunk c
        return not (c == 0 and self.first)

    def run(self) -> None:
        self.rb.call(recv_prev=not self.first)
        for k in range(self.warmup):
            self.warmup_step(k)
        for k in range(self.remaining):
            self.steady_overlapped(k) if self.overlap else self.steady_blocking(k)
        if self.all_warmup:
            self.rb.call(recv_next=not self.last)
        for k in range(self.remaining, self.total):
            self.cooldown_step(k)
        if self.send_prev_h is not None:
            self.rb.wait(self.send_prev_h)
        assert not self.recv_prev_q and not self.recv_next_q, "receives left pending"

    def warmup_step(self, k: int) -> None:
        recv_prev = self.recv_from_previous(k, True) and k != self.total - 1
        send = self.fwd(k)
        last_warmup = k == self.warmup - 1 and not self.all_warmup
        if last_warmup and not self.overlap:
            self.rb.call(send_next=send, recv_prev=recv_prev, recv_next=not self.last)
        else:
            self.rb.call(send_next=send, recv_prev=recv_prev)
        if last_warmup and self.overlap and not self.last:
            self.recv_next_q.append(self.rb.post(recv_next=True)["recv_next"])

    def steady_overlapped(self, k: int) -> None:
        """pp_pre_forward, forward, pp_post_forward, pp_pre_backward, backward, pp_post_backward."""
        rb, fk = self.rb, k + self.warmup
        if not (self.chunk(fk, True) == 0 and self.first) and self.recv_prev_q:
            rb.wait(self.recv_prev_q.pop(0))
        send = self.fwd(fk)
        recv_prev = self.recv_from_previous(fk, True) and k != self.remaining - 1
        keys = rb.post(send_next=send, recv_prev=recv_prev)
        if self.send_next_h is not None:
            rb.wait(self.send_next_h)
        if recv_prev:
            self.recv_prev_q.append(keys["recv_prev"])
        if send:                             # deallocate_pipeline_outputs: wait for the send at once
            rb.wait(keys["send_next"])
        self.send_next_h = None
        if not (self.chunk(k, False) == self.v - 1 and self.last) and self.recv_next_q:
            rb.wait(self.recv_next_q.pop(0))
        send = self.bwd(k)
        recv_next = self.recv_from_previous(k, False)
        keys = rb.post(send_prev=send, recv_next=recv_next)
        if self.send_prev_h is not None:
            rb.wait(self.send_prev_h)
        self.send_prev_h = keys.get("send_prev")
        if recv_next:
            self.recv_next_q.append(keys["recv_next"])

    def steady_blocking(self, k: int) -> None:
        """--no-overlap-p2p-communication: one combined blocking call per step."""
        fk = k + self.warmup
        send_f, send_b = self.fwd(fk), self.bwd(k)
        recv_prev = self.recv_from_previous(fk, True) and k != self.remaining - 1
        self.rb.call(send_next=send_f, send_prev=send_b, recv_prev=recv_prev,
                     recv_next=self.recv_from_previous(k, False))

    def cooldown_step(self, k: int) -> None:
        if not (self.chunk(k, False) == self.v - 1 and self.last) and k != 0 and self.recv_next_q:
            self.rb.wait(self.recv_next_q.pop(0))
        recv_next = self.recv_from_previous(k, False) and k != self.total - 1
        send = self.bwd(k)
        self.rb.call(send_prev=send, recv_next=recv_next)


def simulate(program: tuple, forward_s: np.ndarray, backward_s: np.ndarray, fwd_comm_s: np.ndarray,
             bwd_comm_s: np.ndarray, *, fwd_xchg_s: np.ndarray | None = None,
             bwd_xchg_s: np.ndarray | None = None, trace: bool = False) -> SimResult:
    """Time a program.

    forward_s, backward_s: (p, v) compute time of one micro-batch of each model chunk on each rank.
    fwd_comm_s[h], bwd_comm_s[h]: one activation (gradient) message on hop h, from rank h to
    (h+1) % p (and back); fwd_xchg_s, bwd_xchg_s: the same messages inside an exchange (default:
    as alone, full duplex). With a leading batch axis ((B, p, v) and (B, p)) every replica is
    timed in one pass: which rank waits on what depends on the program only, not on times.
    `trace` (unbatched only) records SimResult.events.
    """
    p = len(program)
    batch = np.ndim(forward_s) == 3
    assert not (trace and batch), "a trace is of one replica"
    events: list[Event] | None = [] if trace else None
    started: dict = {}     # key -> when the transfer started (traced runs only)
    if batch:
        mx, zero = np.maximum, np.zeros(np.shape(forward_s)[0])
        cols = [np.ascontiguousarray(np.moveaxis(np.asarray(a, dtype=float), 0, -1))
                for a in (forward_s, backward_s, fwd_comm_s, bwd_comm_s)]
        fwd, bwd, comm = cols[0], cols[1], (cols[2], cols[3])
        xchg = tuple(c if x is None else np.ascontiguousarray(np.moveaxis(np.asarray(x, dtype=float), 0, -1))
                     for c, x in zip(comm, (fwd_xchg_s, bwd_xchg_s)))
    else:
        mx, zero = max, 0.0
        fwd = np.asarray(forward_s, dtype=float).reshape(p, -1).tolist()
        bwd = np.asarray(backward_s, dtype=float).reshape(p, -1).tolist()
        comm = (np.asarray(fwd_comm_s, dtype=float).tolist(), np.asarray(bwd_comm_s, dtype=float).tolist())
        xchg = tuple(c if x is None else np.asarray(x, dtype=float).tolist()
                     for c, x in zip(comm, (fwd_xchg_s, bwd_xchg_s)))
    clock, pc, last_bwd = [zero] * p, [0] * p, [zero] * p
    posted: dict = {}      # key -> (post time, paired) of the first side to post
    done: dict = {}        # key -> end time, once both sides posted
    waiting: dict = {}     # key -> ranks blocked on it
    runnable = list(range(p))
    while runnable:
        r = runnable.pop()
        ops, t, i = program[r], clock[r], pc[r]
        while i < len(ops):
            op = ops[i]
            if op[0] == COMPUTE:
                kind, c = op[1], op[2]
                d = fwd[r][c] if kind == FORWARD else bwd[r][c]
                begin, t = t, t + d
                if kind == BACKWARD:
                    last_bwd[r] = t
                if events is not None:
                    events.append(Event(rank=r, what="forward" if kind == FORWARD else "backward", start_s=begin,
                                        end_s=t, chunk=c, microbatch=op[3]))
            elif op[0] == POST:
                for key, _, paired in op[1]:
                    other = posted.pop(key, None)
                    if other is None:
                        posted[key] = (t, paired)
                        continue
                    src, dst, direction, _ = key
                    rates = xchg if paired and other[1] else comm
                    done[key] = mx(t, other[0]) + rates[direction][src if direction == FORWARD else dst]
                    if events is not None:
                        started[key] = mx(t, other[0])
                    runnable.extend(waiting.pop(key, ()))
            else:
                pending = next((k for k in op[1] if k not in done), None)
                if pending is not None:
                    waiting.setdefault(pending, []).append(r)
                    break
                blocked = t
                t = reduce(mx, (done[k] for k in op[1]), t)
                if events is not None and t > blocked:
                    moving = min(t, max(blocked, started[max(op[1], key=done.__getitem__)]))
                    events += [Event(rank=r, what=what, start_s=a, end_s=b) for what, a, b in
                               (("wait", blocked, moving), ("p2p", moving, t)) if b > a]
            i += 1
        clock[r], pc[r] = t, i
    stuck = [r for r in range(p) if pc[r] < len(program[r])]
    assert not stuck, f"pipeline schedule deadlocks: ranks {stuck} blocked at ops {[pc[r] for r in stuck]}"
    end, finish = np.stack(clock, axis=-1), np.stack(last_bwd, axis=-1)
    return SimResult(total_s=end.max(axis=-1), finish_s=finish, end_s=end, events=tuple(events or ()))
