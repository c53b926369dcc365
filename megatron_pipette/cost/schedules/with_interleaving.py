"""Interleaved: megatron-core's forward_backward_pipelining_with_interleaving (async p2p). Exact: a
wave recurrence over the ranks (cost.interleaved) that skips the periodic steady-state groups;
extrapolated (and flagged inexact) only for a replica whose steady state has not become periodic
after a few groups. Its gradient reductions and parameter all-gathers are aligned across stages
(align_grad_reduce, align_param_gather)."""

from __future__ import annotations

import numpy as np

from megatron_pipette.cost import simulator
from megatron_pipette.cost.interleaved import interleaved_time
from megatron_pipette.cost.schedules.base import InFlight, PipelineTime, Schedule, StageTimes


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


def busy(times: StageTimes, m: int) -> tuple[np.ndarray, np.ndarray]:
    batch, p, v = times.shape
    warm_step, steady_step, cool_step = _interleaved_steps(times)
    f, b = times.forward_s.mean(axis=2), times.backward_s.mean(axis=2)
    warm = np.array([simulator.interleaved_warmup(p, r, m, v, p) for r in range(p)])
    p2p = warm * (warm_step - f + cool_step - b) + (m * v - warm) * (steady_step - f - b)
    return m * (times.forward_s.sum(axis=2) + times.backward_s.sum(axis=2)) + p2p, p2p


def interleaved(times: StageTimes, m: int) -> PipelineTime:
    """Exact (the simulator's answer) by a wave recurrence over the ranks (`cost.interleaved`);
    long runs skip the micro-batch groups of the periodic steady state. `exact` is False only
    if some replica had not become periodic after MAX_GROUPS groups and was extrapolated."""
    batch, p, v = times.shape
    assert v >= 2 and p >= 2 and m % p == 0, "interleaving needs PP >= 2, >= 2 chunks and M % PP == 0"
    run = interleaved_time(times.forward_s, times.backward_s, times.fwd_comm_s, times.bwd_comm_s, m)
    busy_s, p2p = busy(times, m)
    return PipelineTime(total_s=run.total_s, finish_s=run.finish_s, busy_s=busy_s, p2p_s=p2p,
                        exact=bool(run.exact.all()))


def warmup(p: int, rank: int, m: int, v: int) -> int:
    """(p - rank - 1) * 2 + (v - 1) * p forwards before the first backward (get_pp_rank_microbatches,
    micro-batch group = PP), at most m * v."""
    return simulator.interleaved_warmup(p, rank, m, v, p)


def in_flight_states(p: int, rank: int, m: int, v: int, warmup: int) -> frozenset[InFlight]:
    """(chunks in flight, of them chunk 0, of them the last chunk) after each forward step.

    Stage 0's chunk 0 holds the embedding and the last stage's last chunk the output layer, so there
    their counts matter apart from the total (elsewhere they are left 0): the schedule is replayed,
    forwards in table order, backwards in table order with the chunk reversed (get_model_chunk_id)."""
    if 0 < rank < p - 1:  # holds neither embedding nor output: only the total matters
        return frozenset({InFlight(chunks=min(warmup + 1, m * v), first_chunk=0, last_chunk=0)})
    # Replayed in arrays (m * v steps, in every search): after forward step s, chunk c holds its
    # forwards up to s less the backwards before it, steps 0 .. s - warmup - 1 reversed.
    order = np.asarray(simulator.forward_chunks(m, v, p))
    steps = np.arange(order.size)
    first_forwards, last_forwards = np.cumsum(order == 0), np.cumsum(order == v - 1)

    def backwards(forwards: np.ndarray) -> np.ndarray:     # forwards of the reversed chunk, shifted
        return np.concatenate([np.zeros(min(warmup + 1, order.size), dtype=int), forwards])[:order.size]
    chunks = steps + 1 - np.maximum(steps - warmup, 0)
    states = zip(chunks.tolist(), (first_forwards - backwards(last_forwards)).tolist(),
                 (last_forwards - backwards(first_forwards)).tolist(), strict=True)
    return frozenset(InFlight(*state) for state in set(states))


def grad_sync_exposed(reduce: np.ndarray, backward: np.ndarray, edge: float = 0.0) -> np.ndarray:
    """(pp,) gradient reduction of each rank still running after its last backward, under
    overlap_grad_reduce (`reduce` (pp,): a rank's whole reduction alone; `backward` (pp, v): its
    backward seconds per chunk; every bucket of a chunk launches at once, so `edge` plays no part).

    forward_backward_pipelining_with_interleaving (backward_step_helper_postprocess) launches
    chunk c's reduction (all of its buckets: grad sync is disabled between backward steps) r
    backward steps after that chunk's last one on pipeline rank r, i.e. c*p - r steps before the
    rank's end: the rest of the backward blocks of chunks c-1 .. 0; chunk 0's at the very end.
    The reductions run one after another on the data-parallel stream, chunk v-1 first."""
    p, v = backward.shape
    r = np.arange(p)
    done = np.full(p, -np.inf)
    for c in range(v - 1, -1, -1):
        window = p * backward[:, :c].sum(axis=1) - r * backward[:, c - 1] if c else np.zeros(p)
        done = np.maximum(done, -window) + reduce / v
    return np.maximum(done, 0.0)


def param_gather_aligned(ag: np.ndarray, forward: np.ndarray, fwd_comm: np.ndarray, first: float,
                         step_window: np.ndarray) -> float:
    """align_param_gather: the schedule dispatches every stage's first chunks at once (param_sync_func),
    so later stages hide theirs behind the pipeline fill and stage 0 waits for its first bucket.
    With --overlap-param-gather-with-optimizer-step the first chunk's all-gather is already running
    (ChainedOptimizer._step dispatches it after that chunk's update) for `step_window` more."""
    fill_f = forward.sum(axis=1)
    fill = np.concatenate([[0.0], np.cumsum(fill_f + fwd_comm)[:-1]])
    waits = np.concatenate([[ag[0] * first], ag[1:] - fill[1:]]) - step_window
    return float(np.maximum(0.0, waits).max())


SCHEDULE = Schedule(name="interleaved", time=interleaved, busy=busy,
                    program=lambda p, m, v: simulator.program_interleaved(p, m, v), warmup=warmup,
                    in_flight_states=in_flight_states, grad_reduce_exposed=grad_sync_exposed,
                    param_gather_exposed=param_gather_aligned)
