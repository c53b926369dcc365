"""What a pipeline schedule is to the cost model: its inputs, its answer, and the Schedule object
that holds everything timing and memory ask of one schedule (cost.schedules registers them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from megatron_pipette.cost import simulator


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


class InFlight(NamedTuple):
    """Model chunks one pipeline rank holds activations of, after one forward step."""

    chunks: int
    first_chunk: int
    """Of them, chunk 0's (stage 0's holds the embedding's)."""
    last_chunk: int
    """Of them, the last chunk's (the last stage's holds the output layer's)."""


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """One of megatron-core's pipeline schedules: everything the cost model asks of it, so that
    timing and memory ask the object instead of comparing names. Integers (p pipeline ranks, m
    micro-batches, v model chunks per rank) are arguments: one object serves every pipeline size."""

    name: str
    """As reports show it (TimeEstimate.schedule)."""
    time: Callable[[StageTimes, int], PipelineTime]
    """The closed form: (stage times, m) -> the pass, batched over replicas."""
    busy: Callable[[StageTimes, int], tuple[np.ndarray, np.ndarray]]
    """(busy_s, p2p_s), (B, p): each rank's own compute and blocking p2p calls, and their p2p part."""
    program: Callable[[int, int, int], tuple]
    """(p, m, v) -> megatron-core's calls rank by rank (cost.simulator), for simulate and trace."""
    simulated: bool = True
    """simulate runs the program; False where the closed form is already the event-by-event answer."""
    warmup: Callable[[int, int, int, int], int]
    """(p, rank, m, v) -> forward steps of the rank before its first backward (get_pp_rank_microbatches)."""
    in_flight_states: Callable[[int, int, int, int, int], frozenset[InFlight]]
    """(p, rank, m, v, warmup) -> the rank's in-flight states after each forward step, for a warmup
    of `warmup` forwards (warmup_microbatches)."""
    grad_reduce_exposed: Callable[[np.ndarray, np.ndarray, float], np.ndarray]
    """(reduce (p,), backward (p, v), edge) -> (p,) each rank's gradient reduction under
    --overlap-grad-reduce still running after its last backward: `reduce` a rank's whole
    reduction alone, `backward` its backward seconds per chunk, `edge` the share of stage 0's
    gradients in its last bucket (cost.timing.edge_bucket_share)."""
    param_gather_exposed: Callable[[np.ndarray, np.ndarray, np.ndarray, float, np.ndarray], float]
    """(ag (p,), forward (p, v), fwd_comm (p,), first, step_window (p,)) -> seconds of the
    distributed optimizer's parameter all-gather under --overlap-param-gather that the next
    pass waits for: `ag` each rank's all-gather alone, `forward` and `fwd_comm` the critical
    replica's forward seconds per chunk and activation hops, `first` the share of stage 0's
    first bucket, `step_window` how long the first chunk's all-gather already ran behind the
    optimizer step (--overlap-param-gather-with-optimizer-step)."""

    def warmup_microbatches(self, p: int, rank: int, m: int, v: int, extra: int = 0) -> int:
        """Forward passes before the first backward, `extra` more under
        --overlap-moe-expert-parallel-comm (cost.memory.extra_warmup), at most all of them."""
        return min(self.warmup(p, rank, m, v) + extra, m * v)

    def microbatches_in_flight(self, p: int, rank: int, m: int, v: int) -> int:
        """Model chunks (micro-batch x chunk) whose activations the rank holds at its peak: its
        warmup forwards and the one before each backward, at most all of them. The same under
        --overlap-moe-expert-parallel-comm: its one more warmup forward stands for the one before
        each backward, which then runs beside it (cost.memory.paired_steps)."""
        return min(self.warmup_microbatches(p, rank, m, v) + 1, m * v)

    def simulate(self, times: StageTimes, m: int) -> PipelineTime:
        """The pass from the event-driven simulator (slow, exact), the busy time counted as `time` does."""
        if not self.simulated:
            return self.time(times, m)
        _, p, v = times.shape
        fx, bx = times.exchange_s
        r = simulator.simulate(self.program(p, m, v), times.forward_s, times.backward_s,
                               times.fwd_comm_s, times.bwd_comm_s, fwd_xchg_s=fx, bwd_xchg_s=bx)
        busy, p2p = self.busy(times, m)
        return PipelineTime(total_s=r.total_s, finish_s=r.finish_s, busy_s=busy, p2p_s=p2p, exact=True)

    def trace(self, times: StageTimes, m: int, replica: int = 0) -> simulator.SimResult:
        """One replica's pass from the event-driven simulator, with every rank's events (pictures)."""
        _, p, v = times.shape
        fx, bx = times.exchange_s
        return simulator.simulate(self.program(p, m, v), times.forward_s[replica], times.backward_s[replica],
                                  times.fwd_comm_s[replica], times.bwd_comm_s[replica], fwd_xchg_s=fx[replica],
                                  bwd_xchg_s=bx[replica], trace=True)
