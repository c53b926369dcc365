"""Pipeline schedules: time of one forward-backward pass from per-stage times.

Every schedule is a function (StageTimes, micro-batches) -> PipelineTime,
vectorised over a leading batch axis (the data-parallel replicas), behind a
registry so a new schedule touches only this file. The derivations are in
docs/time-model.md; `cost.simulator` is the reference the tests hold them to.

- "1f1b": megatron-core's forward_backward_pipelining_without_interleaving with
  its blocking, batched p2p calls. Exact: a closed form for m >= 2p-1 and a
  dynamic programme over the same event lattice for m < 2p-1.
- "interleaved": forward_backward_pipelining_with_interleaving (async p2p).
  Exact: a wave recurrence over the ranks (`cost.interleaved`) that skips the
  periodic steady-state groups; extrapolated (and flagged inexact) only for a
  replica whose steady state has not become periodic after a few groups.
- "no-pipelining": PP = 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron_pipette.cost import simulator
from megatron_pipette.cost.interleaved import interleaved_time

NEG = -np.inf


@dataclass(frozen=True, kw_only=True)
class StageTimes:
    """What a schedule needs, with a leading batch axis (replicas)."""

    forward_s: np.ndarray
    """(B, p, v) forward time of one micro-batch of each model chunk on each pipeline rank."""
    backward_s: np.ndarray
    """(B, p, v) backward time (recomputation included)."""
    fwd_comm_s: np.ndarray
    """(B, p) one activation message on hop h, rank h -> (h+1) % p; hop p-1 wraps (interleaving only)."""
    bwd_comm_s: np.ndarray
    """(B, p) one gradient message on hop h, rank (h+1) % p -> h."""
    fwd_xchg_s: np.ndarray | None = None
    """(B, p) the activation message on hop h while the gradient goes back at the same time
    (1F1B's exchanges); None: as fast as alone (full-duplex links)."""
    bwd_xchg_s: np.ndarray | None = None
    """(B, p) the gradient message on hop h inside an exchange; None: as alone."""

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.forward_s.shape

    @property
    def exchange_s(self) -> tuple[np.ndarray, np.ndarray]:
        """(fwd, bwd) per-hop message times inside an exchange."""
        return (self.fwd_comm_s if self.fwd_xchg_s is None else self.fwd_xchg_s,
                self.bwd_comm_s if self.bwd_xchg_s is None else self.bwd_xchg_s)


@dataclass(frozen=True, kw_only=True)
class PipelineTime:
    total_s: np.ndarray
    """(B,) end of the forward-backward pass (the last rank's last op)."""
    finish_s: np.ndarray
    """(B, p) end of each rank's last backward: its data-parallel reduction may start then."""
    busy_s: np.ndarray
    """(B, p) time each rank spends in its own compute and blocking p2p calls."""
    p2p_s: np.ndarray
    """(B, p) the p2p part of busy_s."""
    exact: bool
    """False where the schedule's closed form is an approximation."""


Schedule = Callable[[StageTimes, int], PipelineTime]
SCHEDULES: dict[str, Schedule] = {}
PROGRAMS: dict[str, Callable[[int, int, int], tuple]] = {}


def register(name: str, program: Callable[[int, int, int], tuple] | None = None):
    """Add a schedule (and the simulator program that checks it) under a name."""
    def wrap(fn: Schedule) -> Schedule:
        SCHEDULES[name] = fn
        if program is not None:
            PROGRAMS[name] = program
        return fn
    return wrap


def pipeline_time(name: str, times: StageTimes, m: int) -> PipelineTime:
    return SCHEDULES[name](times, m)


def simulate_pipeline(name: str, times: StageTimes, m: int) -> PipelineTime:
    """The same quantities from the event-driven simulator (slow, exact)."""
    if name not in PROGRAMS:
        return SCHEDULES[name](times, m)
    _, p, v = times.shape
    fx, bx = times.exchange_s
    r = simulator.simulate(PROGRAMS[name](p, m, v), times.forward_s, times.backward_s,
                           times.fwd_comm_s, times.bwd_comm_s, fwd_xchg_s=fx, bwd_xchg_s=bx)
    total, finish = r.total_s, r.finish_s
    busy, p2p = _busy_1f1b(times, m) if name == "1f1b" else _busy_interleaved(times, m)
    return PipelineTime(total_s=total, finish_s=finish, busy_s=busy, p2p_s=p2p, exact=True)


def trace_pipeline(name: str, times: StageTimes, m: int, replica: int = 0) -> simulator.SimResult:
    """One replica's pass from the event-driven simulator, with every rank's events (pictures).
    Without pipelining Megatron runs forward_backward_no_pipelining, one forward then one backward
    per micro-batch: 1F1B's program on one rank."""
    _, p, v = times.shape
    program = simulator.program_1f1b(p, m) if name == "no-pipelining" else PROGRAMS[name](p, m, v)
    fx, bx = times.exchange_s
    return simulator.simulate(program, times.forward_s[replica], times.backward_s[replica],
                              times.fwd_comm_s[replica], times.bwd_comm_s[replica], fwd_xchg_s=fx[replica],
                              bwd_xchg_s=bx[replica], trace=True)


# --- no pipelining -----------------------------------------------------------------------------

@register("no-pipelining")
def no_pipelining(times: StageTimes, m: int) -> PipelineTime:
    work = m * (times.forward_s.sum(axis=2) + times.backward_s.sum(axis=2))
    zero = np.zeros_like(work)
    return PipelineTime(total_s=work[:, 0], finish_s=work, busy_s=work, p2p_s=zero, exact=True)


# --- 1F1B --------------------------------------------------------------------------------------

def _hops(times: StageTimes) -> tuple[np.ndarray, ...]:
    """Per-hop durations padded with the virtual hops -1 and p-1 (zero): index h+1 is hop h.
    phi, beta: a message alone; x: an exchange (both messages at once, each at the two-way rate)."""
    batch, p, _ = times.shape
    z = np.zeros((batch, 1))

    def pad(a: np.ndarray) -> np.ndarray:
        return np.concatenate([z, a[:, :p - 1], z], axis=1)
    fx, bx = times.exchange_s
    return pad(times.fwd_comm_s), pad(times.bwd_comm_s), np.maximum(pad(fx), pad(bx))


def _busy_1f1b(times: StageTimes, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Each stage's own compute plus its p2p calls (the event counts of the lattice)."""
    batch, p, _ = times.shape
    phi, beta, x = _hops(times)
    s = np.arange(p)
    w = np.minimum(p - s - 1, m)
    steady = m - w
    # hop s-1 (index s): w+1 forward receives, steady-1 exchanges, 1 + w backward sends;
    # hop s (index s+1): w forward sends, steady exchanges, w backward receives.
    prev = (w + (steady > 0)) * phi[:, :p] + np.maximum(steady - 1, 0) * x[:, :p] + (w + (steady > 0)) * beta[:, :p]
    nxt = w * phi[:, 1:] + steady * x[:, 1:] + w * beta[:, 1:]
    p2p = prev + nxt
    return m * (times.forward_s[:, :, 0] + times.backward_s[:, :, 0]) + p2p, p2p


def _prefix(a: np.ndarray) -> np.ndarray:
    """Prefix sums along the last axis with a leading zero: out[k] = sum(a[:k])."""
    return np.concatenate([np.zeros(a.shape[:-1] + (1,)), np.cumsum(a, axis=-1)], axis=-1)


def _one_f_one_b_closed(f, b, phi, beta, x, m):
    """Exact for m >= 2p-1: per region (warmup, steady, cooldown) the longest path cycles at
    one stage; entry/exit hops join the regions (docs/time-model.md, "1F1B")."""
    batch, p = f.shape
    c = f + b + x[:, 1:] + x[:, :-1]            # steady cycle of stage s: F, exchange, B, exchange
    cw = f + phi[:, 1:] + phi[:, :-1]           # warmup cycle: receive, F, send
    g = np.cumsum(f + x[:, 1:], axis=1)         # g[k] = sum_{s<=k} f_s + x_s
    gw, pc, pcw = _prefix(f + phi[:, 1:]), _prefix(c), _prefix(cw)
    h = np.arange(p)[:, None]                   # entry/exit hop
    sg = np.arange(p)[None, :]                  # cycling stage
    # W(h): longest path to the first steady event on hop h (warmup cycles at sigma).
    n = p - 1 - np.maximum(h, sg)
    ok = (sg < h) | (n >= 1)
    cand = (pcw[:, None, :p] - pcw[:, :p, None]) * (sg > h) + n * cw[:, None, :]
    entry = gw[:, :p] + np.where(ok, cand, NEG).max(axis=2) + f + x[:, 1:]
    # A(sigma): best entry into cycling at sigma in the steady region.
    a = ((entry - g)[:, :, None] + (pc[:, 1:, None] - pc[:, None, 1:]) * (h > sg)
         + np.minimum(h, sg) * c[:, None, :]).max(axis=1)
    # E(h): longest path to the last steady event on hop h.
    z = (pc[:, None, :p] - pc[:, 1:, None]) * (sg > h + 1) - np.maximum(0, sg - h - 1) * c[:, None, :]
    exit_ = ((m - p) * c + a)[:, None, :] + z
    return exit_.max(axis=2) + g


def _cooldown(e, b, beta, m):
    """Column-by-column longest paths through the cooldown triangle from the steady exits e."""
    batch, p = b.shape
    finish = np.empty((batch, p))
    finish[:, p - 1] = e[:, p - 1] + b[:, p - 1]
    up = e + b + beta[:, :p]                    # up[k]: arrives at hop k-1 in column m
    col = up
    for j in range(m, m + p):
        top = m + p - 2 - j                     # deepest hop in column j
        pre = np.cumsum(beta[:, :top + 2], axis=1)
        col = np.maximum.accumulate(up[:, :top + 2] - pre, axis=1) + pre
        if top >= 0:
            finish[:, top] = col[:, top + 1] + b[:, top]
            up = col[:, 1:] + b[:, :top + 1] + beta[:, :top + 1]
    return col[:, 0], finish


def _one_f_one_b_lattice(f, b, phi, beta, x, m):
    """Exact longest path over the whole event lattice, column by column (m < 2p-1).

    Column j holds forward j on every hop (j < m) and backward j-(p-1-h) on hop h where that
    is a micro-batch: a full column, or in the cooldown a band of hops. An event waits for the
    stage below it (the previous hop in its column, across that stage's forward) and the stage
    above it (the next hop in the previous column, across its backward). A stage that runs
    all-warmup (m < p) also waits for its own last forward send before its first backward, but
    the stage above took part in that send, so the second edge already covers it."""
    batch, p = f.shape
    hops = np.arange(-1, p)
    fpad = np.concatenate([np.zeros((batch, 1)), f], axis=1)
    finish = np.empty((batch, p))
    prev = np.full((batch, p + 1), NEG)
    had_backward = np.zeros(p + 1, dtype=bool)
    for j in range(m + p):
        fw = j < m
        backward = hops + j - (p - 1)
        bw = (backward >= 0) & (backward < m)
        d = np.where(bw, np.where(fw, x, beta), phi if fw else 0.0)
        arrive = np.full((batch, p + 1), NEG)
        arrive[:, :p] = prev[:, 1:] + b * had_backward[1:]
        if j == 0:
            arrive[:, 0] = 0.0
        s = np.cumsum(fpad * fw + d, axis=1)
        prev = np.where(fw | bw, s + np.maximum.accumulate(arrive + d - s, axis=1), NEG)
        had_backward = bw
        if j == m - 1:
            finish[:, p - 1] = prev[:, p] + b[:, p - 1]
        top = m + p - 2 - j                      # hop of the last backward in this column
        if j >= m and 0 <= top <= p - 2:
            finish[:, top] = prev[:, top + 1] + b[:, top]
    return prev[:, 0], finish


@register("1f1b", lambda p, m, v: simulator.program_1f1b(p, m))
def one_f_one_b(times: StageTimes, m: int) -> PipelineTime:
    batch, p, v = times.shape
    assert v == 1, "1F1B runs one model chunk per rank"
    busy, p2p = _busy_1f1b(times, m)
    f, b = times.forward_s[:, :, 0], times.backward_s[:, :, 0]
    phi, beta, x = _hops(times)
    if m >= 2 * p - 1:
        total, finish = _cooldown(_one_f_one_b_closed(f, b, phi, beta, x, m), b, beta, m)
    else:
        total, finish = _one_f_one_b_lattice(f, b, phi, beta, x, m)
    return PipelineTime(total_s=total, finish_s=finish, busy_s=busy, p2p_s=p2p, exact=True)


# --- interleaved -------------------------------------------------------------------------------

def _send_wait(times: StageTimes) -> np.ndarray:
    """(B, p) average forward-send wait per forward step: Megatron waits for each activation
    send at once (deallocate_pipeline_outputs); the last rank does not send its last chunk."""
    batch, p, v = times.shape
    share = np.ones(p)
    share[-1] = (v - 1) / v
    return times.fwd_comm_s * share


def _interleaved_steps(times: StageTimes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B, p) per chunk-step time on each rank in warmup (a blocking send + receive call after each
    forward), steady state (forward, its send wait, backward; gradient sends are async) and
    cooldown (a blocking send + receive call after each backward)."""
    f, b = times.forward_s.mean(axis=2), times.backward_s.mean(axis=2)
    send = _send_wait(times)
    recv_f = np.roll(times.fwd_comm_s, 1, axis=1)       # rank r receives activations on hop r-1
    recv_b = times.bwd_comm_s                           # and gradients on hop r
    send_b = np.roll(times.bwd_comm_s, 1, axis=1)       # and sends gradients on hop r-1
    return f + np.maximum(send, recv_f), f + send + b, b + np.maximum(send_b, recv_b)


def _busy_interleaved(times: StageTimes, m: int) -> tuple[np.ndarray, np.ndarray]:
    batch, p, v = times.shape
    warm_step, steady_step, cool_step = _interleaved_steps(times)
    f, b = times.forward_s.mean(axis=2), times.backward_s.mean(axis=2)
    warm = np.array([simulator.interleaved_warmup(p, r, m, v, p) for r in range(p)])
    p2p = warm * (warm_step - f + cool_step - b) + (m * v - warm) * (steady_step - f - b)
    return m * (times.forward_s.sum(axis=2) + times.backward_s.sum(axis=2)) + p2p, p2p


@register("interleaved", lambda p, m, v: simulator.program_interleaved(p, m, v))
def interleaved(times: StageTimes, m: int) -> PipelineTime:
    """Exact (the simulator's answer) by a wave recurrence over the ranks (`cost.interleaved`);
    long runs skip the micro-batch groups of the periodic steady state. `exact` is False only
    if some replica had not become periodic after MAX_GROUPS groups and was extrapolated."""
    batch, p, v = times.shape
    assert v >= 2 and p >= 2 and m % p == 0, "interleaving needs PP >= 2, >= 2 chunks and M % PP == 0"
    total, finish, exact = interleaved_time(times.forward_s, times.backward_s, times.fwd_comm_s,
                                            times.bwd_comm_s, m)
    busy, p2p = _busy_interleaved(times, m)
    return PipelineTime(total_s=total, finish_s=finish, busy_s=busy, p2p_s=p2p, exact=bool(exact.all()))


def schedule_name(pp: int, virtual_stages: int) -> str:
    """Megatron's choice: no pipelining at PP 1, interleaving with model chunks, else 1F1B."""
    if pp == 1:
        return "no-pipelining"
    return "interleaved" if virtual_stages > 1 else "1f1b"
