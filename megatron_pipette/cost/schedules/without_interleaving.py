"""1F1B: megatron-core's forward_backward_pipelining_without_interleaving with its blocking, batched
p2p calls. Exact: a closed form for m >= 2p-1 and a dynamic programme over the same event lattice
for m < 2p-1 (docs/time-model.md, "1F1B"). Its data-parallel rules (no aligned reduction or
all-gather) are also forward_backward_no_pipelining's."""

from __future__ import annotations

import numpy as np

from megatron_pipette.cost import simulator
from megatron_pipette.cost.schedules.base import InFlight, PipelineTime, Schedule, StageTimes

NEG = -np.inf


def _hops(times: StageTimes) -> tuple[np.ndarray, ...]:
    """Per-hop durations padded with the virtual hops -1 and p-1 (zero): index h+1 is hop h.
    phi, beta: a message alone; x: an exchange (both messages at once, each at the two-way rate)."""
    batch, p, _ = times.shape
    z = np.zeros((batch, 1))

    def pad(a: np.ndarray) -> np.ndarray:
        return np.concatenate([z, a[:, :p - 1], z], axis=1)
    fx, bx = times.exchange_s
    return pad(times.fwd_comm_s), pad(times.bwd_comm_s), np.maximum(pad(fx), pad(bx))


def busy(times: StageTimes, m: int) -> tuple[np.ndarray, np.ndarray]:
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
    nothing = np.zeros_like(fpad)
    finish = np.empty((batch, p))
    prev = np.full((batch, p + 1), NEG)
    arrive = np.full((batch, p + 1), NEG)       # hop p-1 never hears from above; rows rewritten per column
    had_backward = np.zeros(p + 1, dtype=bool)
    for j in range(m + p):
        fw = j < m
        backward = hops + j - (p - 1)
        bw = (backward >= 0) & (backward < m)
        d = np.where(bw, x if fw else beta, phi if fw else nothing)
        np.add(prev[:, 1:], b * had_backward[1:], out=arrive[:, :p])
        if j == 0:
            arrive[:, 0] = 0.0
        s = np.cumsum((fpad if fw else nothing) + d, axis=1)
        prev = np.where(fw | bw, s + np.maximum.accumulate(arrive + d - s, axis=1), NEG)
        had_backward = bw
        if j == m - 1:
            finish[:, p - 1] = prev[:, p] + b[:, p - 1]
        top = m + p - 2 - j                      # hop of the last backward in this column
        if j >= m and 0 <= top <= p - 2:
            finish[:, top] = prev[:, top + 1] + b[:, top]
    return prev[:, 0], finish


def one_f_one_b(times: StageTimes, m: int) -> PipelineTime:
    batch, p, v = times.shape
    assert v == 1, "1F1B runs one model chunk per rank"
    busy_s, p2p = busy(times, m)
    f, b = times.forward_s[:, :, 0], times.backward_s[:, :, 0]
    phi, beta, x = _hops(times)
    if m >= 2 * p - 1:
        total, finish = _cooldown(_one_f_one_b_closed(f, b, phi, beta, x, m), b, beta, m)
    else:
        total, finish = _one_f_one_b_lattice(f, b, phi, beta, x, m)
    return PipelineTime(total_s=total, finish_s=finish, busy_s=busy_s, p2p_s=p2p, exact=True)


def warmup(p: int, rank: int, m: int, v: int) -> int:
    """p - rank - 1 forwards before the first backward (get_pp_rank_microbatches), at most m."""
    return simulator.interleaved_warmup(p, rank, m, v, p)


def peak_in_flight(p: int, rank: int, m: int, v: int, warmup: int) -> frozenset[InFlight]:
    """One chunk per rank: the peak alone, the warmup forwards and the one before each backward."""
    n = min(warmup + 1, m * v)
    return frozenset({InFlight(chunks=n, first_chunk=n, last_chunk=n)})


def overlapped(total: float | np.ndarray, window: float | np.ndarray, last: float | np.ndarray) -> np.ndarray:
    """Exposed part of a reduction issued bucket by bucket while a backward of `window` seconds
    produces the gradients: all but the last bucket (`last`, its share of the total) hide, as far
    as the window allows. Floats or arrays (cost.fsdp's layer-by-layer gathers, per chunk)."""
    return np.maximum(total * last, total - window * (1 - last))


def first_stage_grad_reduce(reduce: np.ndarray, backward: np.ndarray, edge: float) -> np.ndarray:
    """Megatron (align_grad_reduce) overlaps only the first stage's reduction with its last backward,
    bucket by bucket; later stages start theirs when they finish (one bucket each), which the max
    over stages in cost.timing hides behind the others' cooldown."""
    exposed = reduce.copy()
    exposed[0] = overlapped(reduce[0], backward[0, 0], edge)
    return exposed


def param_gather_at_first_forward(ag: np.ndarray, forward: np.ndarray, fwd_comm: np.ndarray, first: float,
                                  step_window: np.ndarray) -> float:
    """Without interleaving Megatron sets align_param_gather = False (megatron/training/arguments.py,
    "non-interleaved schedule does not support ... aligned param AG"), so no stage starts its
    all-gather before its first forward pre-hook (DistributedDataParallel._make_forward_pre_hook ->
    finish_param_sync dispatches it): stage 0 waits for its first bucket (`first`, its share) and
    prefetches the rest behind its first forward (F_0); every later stage (one bucket: bucketing is
    for the first stage only) waits for all of its own, and the pipeline fill waits for each in turn:
    max(AG_0 - F_0, AG_0 x first) + sum over r >= 1 of AG_r. Megatron allows
    --overlap-param-gather-with-optimizer-step only with interleaving: `step_window` plays no part."""
    fill_f = forward.sum(axis=1)
    return float(max(ag[0] - fill_f[0], ag[0] * first) + ag[1:].sum())


SCHEDULE = Schedule(name="1f1b", time=one_f_one_b, busy=busy, program=lambda p, m, v: simulator.program_1f1b(p, m),
                    warmup=warmup, in_flight_states=peak_in_flight, grad_reduce_exposed=first_stage_grad_reduce,
                    param_gather_exposed=param_gather_at_first_forward)
