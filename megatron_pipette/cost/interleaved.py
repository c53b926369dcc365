"""Exact timing of megatron-core's interleaved schedule by a wave recurrence.

`forward_backward_pipelining_with_interleaving` (overlap_p2p_comm, no batch_p2p_comm,
deallocate_pipeline_outputs, micro-batch group = PP) as `cost.simulator.program_interleaved`
issues it, timed with the simulator's rendezvous semantics, but without its event queue.

Label rank r's forward j with the wave j - W_r - r (W_r = 2(p-1-r) + (v-1)p, the uncapped
warmup) and its backward k with the wave k - r. Every p2p message then joins a sender's and a
receiver's post of the *same* wave on neighbouring ranks (cyclically: hop p-1 wraps from the
last rank to the first), and every wait points to the same or the previous wave. So one pass
over the waves, vectorised over ranks and replicas, is the simulator's answer: per wave and
rank (pF, pB: the post after the forward / backward; X, Y: the arrival of the activation /
gradient a rank waits for; E: the end of the rank's step)

    a   = max(E, X if the forward waits for an input, Y in the cooldown)
    pF  = a + f
    X'  = max(pF[r-1], pF[r]) + phi[r-1]             the next activation into r
    pB  = max(pF, X'[r+1] if r sends, Y in the steady state) + b
          (warmup: also the blocking receive X'; it posts the first gradient receive)
    Y'  = max(pB[r], pB[r+1]) + beta[r]              the next gradient into r
    E   = max(pB, Y[r-1] (steady: the previous gradient send), Y'[r-1] and Y'[r] (cooldown:
          a blocking send and receive))

with warmup (forward only, blocking calls), steady (both, async posts) and cooldown
(backward only, blocking calls) selected per (wave, rank) by masks that depend on (p, m, v)
only (cached); a message that does not exist has hop time -inf. Checked against the
simulator to rounding (tests).

Cost: the pass has m*v + W_0 waves of ~14 small numpy operations. For long runs it is cut
short: once every rank is in the steady state the masks and the stage times repeat every
p*v waves (one micro-batch group), so the waves form a max-plus linear map per group. When
a replica's state (E, X, Y) moved by the same constant in every live component over the last
c groups (c = 1 or 2), every later c groups add that constant exactly (a max-plus map commutes
with adding a constant), so whole periods are skipped and the cooldown is run from the
shifted state: still exact. A replica not periodic after `max_groups` groups is extrapolated
component by component from its last group (an approximation, reported through `exact`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from megatron_pipette.cost import simulator

NEG = -np.inf
MAX_GROUPS = 8
"""Steady groups simulated at most before extrapolating a replica that is not yet periodic."""
MAX_CYCLICITY = 2
"""Periods of 1 or 2 groups are detected (2 occurs: two alternating critical paths)."""
STEADY, WARMUP, COOLDOWN, MIXED = range(4)
"""Wave kinds: every rank steady (or idle); every rank before its first backward (warmup or not yet
started); every rank past its last forward (cooldown or done); anything else (general masks)."""
PERIODIC_RTOL = 1e-12
"""A group's shift is uniform when its spread is below this times the clock (rounding)."""


@dataclass(frozen=True)
class _Structure:
    p: int
    v: int
    mv: int
    w0: int                  # first wave
    steady_lo: int           # waves [steady_lo, steady_hi) repeat every p*v waves
    steady_hi: int
    waves: np.ndarray        # simulated-capable waves (head then tail)
    head_end: int            # waves[:head_end] are w0 ... ; the rest the tail
    rank_idx: np.ndarray     # (nw, p) rank (for gathering stage times)
    f_chunk: np.ndarray      # (nw, p) chunk of the forward, v where none
    b_chunk: np.ndarray      # (nw, p) chunk of the backward, v where none
    msg_x: np.ndarray        # (nw, p, 1) 0 where an activation arrives at rank r for wave w+1, else -inf
    msg_y: np.ndarray        # (nw, p, 1) the same for gradients
    ops: tuple               # per wave: (kind, None) or (MIXED, _MixedMasks)
    last_bwd: tuple          # per wave: rank whose last backward it is, or -1
    checks: frozenset        # wave indices where a group starts inside the periodic region


class _MixedMasks(NamedTuple):
    """A MIXED wave's additive (p, 1) masks (_additive) of the ranks in each phase."""

    warm: np.ndarray | None
    """In the warmup."""
    cool: np.ndarray | None
    """In the cooldown."""
    not_first_cool: np.ndarray | None
    """Not at their first cooldown step."""
    first_cool: np.ndarray | None
    """At their first cooldown step."""


def _additive(mask: np.ndarray) -> np.ndarray | None:
    """0 where set, -inf elsewhere, shaped (p, 1) to broadcast over replicas; None when all unset."""
    if not mask.any():
        return None
    return np.where(mask, 0.0, NEG)[:, None]


# Module-level memo (cost.model lists them): the wave structure depends on (p, m, v) alone.
@lru_cache(maxsize=1024)
def _structure(p: int, m: int, v: int, max_groups: int) -> _Structure:
    mv, pv = m * v, p * v
    chunks = np.array(simulator.forward_chunks(m, v, p))
    wu = np.array([2 * (p - 1 - r) + (v - 1) * p for r in range(p)])
    w0 = -int(wu[0])
    steady_lo, steady_hi = 1, mv - int(wu[0])                     # every rank steady at w and w-1
    head_end = min(mv, steady_lo + max_groups * pv + 1)          # the last jump is decided in the head
    tail_start = max(head_end, steady_hi - 1 - MAX_CYCLICITY * pv)   # every possible landing wave
    waves = np.concatenate([np.arange(w0, head_end), np.arange(tail_start, mv)])
    r = np.arange(p)
    first, last = r == 0, r == p - 1

    def at(wv: np.ndarray) -> dict:
        j = wv[:, None] + r[None, :] + wu[None, :]
        kb = wv[:, None] + r[None, :]
        has_f, has_b = (j >= 0) & (j < mv), (kb >= 0) & (kb < mv)
        c_f = np.where(has_f, chunks[np.clip(j, 0, mv - 1)], v)
        c_b = np.where(has_b, v - 1 - chunks[np.clip(kb, 0, mv - 1)], v)
        return dict(kb=kb, c_f=c_f, c_b=c_b, warm=has_f & ~has_b, steady=has_f & has_b, cool=has_b & ~has_f,
                    # the first rank's chunk-0 forwards read the data, the last rank's last-chunk
                    # backwards start from the loss: every other forward / backward takes a message
                    need_x=has_f & ~(first & (c_f == 0)), need_y=has_b & ~(last & (c_b == v - 1)))

    cur, prev, nxt = at(waves), at(waves - 1), at(waves + 1)
    # a message exists iff its receiver consumes it, so its existence is folded into the hop
    # time (-inf where none); only the phase of the waiting rank remains to be masked.
    msg_x, msg_y = nxt["need_x"], nxt["need_y"]
    first_cool = cur["cool"] & prev["steady"]
    no_b, no_f = ~(cur["kb"] >= 0).any(axis=1), ~cur["steady"].any(axis=1) & ~cur["warm"].any(axis=1)
    kinds = np.where(~(cur["warm"] | cur["cool"]).any(axis=1), STEADY,
                     np.where(no_b, WARMUP, np.where(no_f & ~first_cool.any(axis=1), COOLDOWN, MIXED)))
    plain = {k: (k, None) for k in (STEADY, WARMUP, COOLDOWN)}
    ops = tuple(plain[k] if k != MIXED else
                (MIXED, _MixedMasks(warm=_additive(cur["warm"][i]), cool=_additive(cur["cool"][i]),
                                    not_first_cool=_additive(~first_cool[i]), first_cool=_additive(first_cool[i])))
                for i, k in enumerate(kinds.tolist()))
    r_last = mv - 1 - waves                                       # whose last backward runs in wave w
    last_bwd = tuple(np.where((r_last >= 0) & (r_last < p), r_last, -1).tolist())
    head = waves[:head_end - w0]
    checks = frozenset(np.flatnonzero((head >= steady_lo) & ((head - steady_lo) % pv == 0)
                                      & (head + pv < steady_hi)).tolist())
    return _Structure(p=p, v=v, mv=mv, w0=w0, steady_lo=steady_lo, steady_hi=steady_hi, waves=waves,
                      head_end=head_end - w0, rank_idx=np.broadcast_to(r, (len(waves), p)),
                      f_chunk=cur["c_f"], b_chunk=cur["c_b"], msg_x=np.where(msg_x, 0.0, NEG)[:, :, None],
                      msg_y=np.where(msg_y, 0.0, NEG)[:, :, None], ops=ops, last_bwd=last_bwd,
                      checks=checks)


_MEMO: OrderedDict = OrderedDict()
"""Module-level memo (cost.model lists them) of interleaved_time, a pure function of its inputs:
the answers to its last _MEMO_SIZE distinct inputs, least recently used dropped first."""
_MEMO_SIZE = 256


class InterleavedTime(NamedTuple):
    """The interleaved schedule's pass, per replica."""

    total_s: np.ndarray
    """(B,) its end."""
    finish_s: np.ndarray
    """(B, p) the end of each rank's last backward."""
    exact: np.ndarray
    """(B,) bool: False where a replica was not periodic after max_groups groups and was extrapolated."""


def interleaved_time(forward_s: np.ndarray, backward_s: np.ndarray, fwd_comm_s: np.ndarray,
                     bwd_comm_s: np.ndarray, m: int, max_groups: int = MAX_GROUPS) -> InterleavedTime:
    """The interleaved schedule's pass.

    forward_s, backward_s: (B, p, v); fwd_comm_s, bwd_comm_s: (B, p), hop p-1 wrapping.
    A pure function of its inputs, so repeated inputs (a planner evaluates layouts that differ
    only outside the pipeline, e.g. optimizer options) are answered from a small memo."""
    arrays = [np.ascontiguousarray(a, dtype=float) for a in (forward_s, backward_s, fwd_comm_s, bwd_comm_s)]
    key = (m, max_groups, forward_s.shape, b"".join(a.tobytes() for a in arrays))
    hit = _MEMO.get(key)
    if hit is None:
        hit = _interleaved_time(*arrays, m, max_groups)
        _MEMO[key] = hit
        if len(_MEMO) > _MEMO_SIZE:
            _MEMO.popitem(last=False)
    else:
        _MEMO.move_to_end(key)
    return InterleavedTime(total_s=hit.total_s.copy(), finish_s=hit.finish_s.copy(), exact=hit.exact.copy())


def _interleaved_time(forward_s: np.ndarray, backward_s: np.ndarray, fwd_comm_s: np.ndarray,
                      bwd_comm_s: np.ndarray, m: int, max_groups: int) -> InterleavedTime:
    batch, p, v = forward_s.shape
    s = _structure(p, m, v, max_groups)
    pv = p * v
    zero = np.zeros((p, 1, batch))
    f = np.concatenate([np.moveaxis(forward_s, 0, -1), zero], axis=1)      # (p, v+1, B)
    b = np.concatenate([np.moveaxis(backward_s, 0, -1), zero], axis=1)
    phi = np.roll(fwd_comm_s, 1, axis=1).T                                 # phi[r-1], (p, B)
    beta = bwd_comm_s.T
    mx, add = np.maximum, np.add
    e = np.zeros((p, batch))
    pf = np.zeros((p + 1, batch))            # rows 1..p: pF; row 0: pF of rank p-1
    pb = np.zeros((p + 1, batch))            # rows 0..p-1: pB; row p: rank 0
    xs = [np.full((p + 1, batch), NEG) for _ in range(2)]      # X: rows 0..p-1, row p: rank 0
    ys = [np.full((p + 1, batch), NEG) for _ in range(2)]      # Y: rows 1..p, row 0: rank p-1
    # per parity: this wave's X (own rows), Y (own, previous rank's), the next wave's X (buffer,
    # own rows, next rank's) and Y (buffer, own rows, previous rank's)
    views = [(xs[c][:p], ys[c][1:], ys[c][:p], xs[1 - c], xs[1 - c][:p], xs[1 - c][1:],
              ys[1 - c], ys[1 - c][1:], ys[1 - c][:p]) for c in (0, 1)]
    bs, tmp = np.empty((p, batch)), np.empty((p, batch))
    fin = np.full((p, batch), NEG)
    finish = np.zeros((p, batch))
    exact = np.ones(batch, dtype=bool)
    pf_own, pb_own = pf[1:], pb[:p]
    hist: list[np.ndarray] = []                              # (E, X, Y) at each group start
    nw, checks = len(s.waves), s.checks
    cur = 0                                                    # parity: xs[cur], ys[cur] hold X_w, Y_w
    group = None                                               # the inputs of the last whole group
    i = 0
    while i < nw:
        if i in checks:
            hist.append(np.concatenate([e, xs[cur][:p], ys[cur][1:]]))
            jump = _periodic_jump(hist, s, int(s.waves[i]), max_groups)
            if jump is not None:
                exact &= jump.exact
                x, y = xs[cur], ys[cur]
                state = hist[-1] + jump.shift
                e[:], x[:p], y[1:] = state[:p], state[p:2 * p], state[2 * p:]
                x[p], y[0] = x[0], y[p]
                target = int(s.waves[i]) + jump.groups * pv
                if target <= s.waves[s.head_end - 1]:
                    i = target - s.w0
                else:
                    assert s.head_end < nw and target >= s.waves[s.head_end], "landing outside the waves"
                    i = s.head_end + int(target - s.waves[s.head_end])
                hist = []
                continue
        stop = min((c for c in checks if c > i), default=nw)
        seg = slice(i, stop)                                   # (waves, p, B): stage times, hop times
        whole = i in checks and stop in checks                 # one group of the periodic region
        if whole and group is not None:                        # its inputs repeat the last group's
            ff, bb, hop_f, hop_b = group
        else:
            ff, bb = f[s.rank_idx[seg], s.f_chunk[seg]], b[s.rank_idx[seg], s.b_chunk[seg]]
            hop_f, hop_b = phi + s.msg_x[seg], beta + s.msg_y[seg]     # -inf: no message
            group = (ff, bb, hop_f, hop_b) if whole else None
        for (kind, masks), f_i, b_i, phi_i, beta_i, r_last in zip(s.ops[seg], ff, bb, hop_f, hop_b,
                                                                 s.last_bwd[seg]):
            x_own, y_own, y_prev, xn, xo, xn_next, yn, yo, yn_prev = views[cur]
            cur ^= 1
            if kind == STEADY:
                mx(e, x_own, out=e)                            # the activation this forward waits for
                _forward(e, f_i, pf, xo, xn, phi_i)
                mx(pf_own, xn_next, out=bs)                    # the activation send
                mx(bs, y_own, out=bs)                          # the gradient
                add(bs, b_i, out=pb_own)
                _gradient(pb, yo, yn, beta_i)                  # the next gradient into each rank
                mx(pb_own, y_prev, out=e)                      # the previous gradient send
            elif kind == WARMUP:                               # blocking send and receive, no gradients
                mx(e, x_own, out=e)
                _forward(e, f_i, pf, xo, xn, phi_i)
                mx(pf_own, xn_next, out=e)
                mx(e, xo, out=e)
            elif kind == COOLDOWN:                             # blocking send and receive, no activations
                mx(e, y_own, out=e)
                add(e, b_i, out=pb_own)
                if r_last >= 0:
                    finish[r_last] = pb_own[r_last]
                _gradient(pb, yo, yn, beta_i)
                mx(pb_own, y_prev, out=e)
                mx(e, yn_prev, out=e)
                mx(e, yo, out=e)
            else:
                warm, cool, not_first_cool, first_cool = masks.warm, masks.cool, masks.not_first_cool, masks.first_cool
                mx(e, x_own, out=e)
                if cool is not None:                           # cooldown: wait for the gradient first
                    add(y_own, cool, out=tmp)
                    mx(e, tmp, out=e)
                _forward(e, f_i, pf, xo, xn, phi_i)
                mx(pf_own, xn_next, out=bs)
                mx(bs, y_own, out=bs)
                add(bs, b_i, out=pb_own)
                if r_last >= 0:
                    finish[r_last] = pb_own[r_last]
                if warm is not None:                           # warmup: blocking receive, then the
                    add(xo, warm, out=tmp)                     # first gradient receive is posted
                    mx(pb_own, tmp, out=pb_own)
                _gradient(pb, yo, yn, beta_i)
                if first_cool is not None:                     # the last steady send is waited for
                    add(y_prev, first_cool, out=tmp)           # only at the very end
                    mx(fin, tmp, out=fin)
                    add(y_prev, not_first_cool, out=tmp)
                    mx(pb_own, tmp, out=e)
                else:
                    mx(pb_own, y_prev, out=e)
                if cool is not None:                           # cooldown: blocking send and receive
                    add(yn_prev, cool, out=tmp)
                    mx(e, tmp, out=e)
                    add(yo, cool, out=tmp)
                    mx(e, tmp, out=e)
        i = stop
    end = np.maximum(e, fin)
    return InterleavedTime(total_s=end.max(axis=0), finish_s=finish.T.copy(), exact=exact)


def _forward(start: np.ndarray, f_i: np.ndarray, pf: np.ndarray, xo: np.ndarray, xn: np.ndarray,
             phi_i: np.ndarray) -> None:
    """pF = start + f, and the next activation into each rank X' = max(pF[r-1], pF[r]) + phi[r-1]
    (pf row 0 and xn row p mirror the wrap-around neighbours)."""
    p = len(start)
    np.add(start, f_i, out=pf[1:])
    pf[0] = pf[p]
    np.maximum(pf[:p], pf[1:], out=xo)
    np.add(xo, phi_i, out=xo)
    xn[p] = xn[0]


def _gradient(pb: np.ndarray, yo: np.ndarray, yn: np.ndarray, beta_i: np.ndarray) -> None:
    """The next gradient into each rank Y' = max(pB[r], pB[r+1]) + beta[r] (pb row p and yn row 0
    mirror the wrap-around neighbours)."""
    p = len(yo)
    pb[p] = pb[0]
    np.maximum(pb[:p], pb[1:], out=yo)
    np.add(yo, beta_i, out=yo)
    yn[0] = yn[p]


class _Jump(NamedTuple):
    """Whole micro-batch groups a pass skips (_periodic_jump)."""

    groups: int
    shift: np.ndarray
    """(3p, B) what the skipped groups add to the state (E, X, Y)."""
    exact: np.ndarray
    """(B,) bool: False where a replica is extrapolated, not periodic."""


def _periodic_jump(hist: list[np.ndarray], s: _Structure, w: int, max_groups: int) -> _Jump | None:
    """The groups to skip, or None to simulate on.

    hist holds the state (E, X, Y) at the start of the last groups (the newest last). A replica is
    periodic with cyclicity c when its state moved by the same amount in every live component
    over the last c groups; then every later c groups move it by that amount again. Replicas that
    are not periodic by the last check are extrapolated component by component (inexact)."""
    n = len(hist) - 1
    if n < 1:
        return None
    state = hist[-1]
    live = np.isfinite(state)                                   # -inf: no message, the same every group
    tol = PERIODIC_RTOL * np.abs(state).max(axis=0, where=live, initial=1.0)
    batch = state.shape[1]
    cyc, rate = np.zeros(batch, dtype=int), np.zeros(batch)
    for c in range(1, min(n, MAX_CYCLICITY) + 1):
        delta = np.subtract(state, hist[n - c], out=np.zeros_like(state), where=live)
        lo = delta.min(axis=0, where=live, initial=np.inf)
        hi = delta.max(axis=0, where=live, initial=NEG)
        new = (hi - lo <= tol) & (cyc == 0)
        cyc[new], rate[new] = c, hi[new] / c
    periodic = cyc > 0
    last = n >= max_groups
    if not (periodic.all() or last):
        return None
    avail = (s.steady_hi - 1 - w) // (s.p * s.v)               # wave steady_hi - 1 looks ahead
    period = int(np.lcm.reduce(cyc[periodic])) if periodic.any() else 1
    groups = avail // period * period
    if groups == 0:
        if not last:
            return None
        groups = avail                                         # no whole period fits: extrapolate
    exact = periodic & (groups % np.maximum(cyc, 1) == 0)
    step = np.subtract(state, hist[n - 1], out=np.zeros_like(state), where=live)
    shift = np.where(exact, groups * rate, groups * step)
    return _Jump(groups=groups, shift=shift, exact=exact)
