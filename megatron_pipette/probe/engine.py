"""The probe's logic, written once against `probe.transport.Transport`.

1. The compute check: every rank's GEMM rate and copy bandwidth, at once.
2. Intra-node rounds (`schedule.probe_rounds`): every node's tournament at the same time.
3. Inter-node rounds: node pairs rail to rail, cross-rail rounds among the first ones.
4. The all-to-all: every block of ALL_TO_ALL_NODES nodes at once (`schedule.all_to_all_peers`).

Each round starts with one agreement (a max over every rank: the clock and the last round's
per-repeat costs) that is both its barrier and its budget check, and that same collective
carries the last round's results to every rank, reduced to O(nodes) numbers: a node pair's
figure is its slowest rail (the largest time), as a pipeline hop or a data-parallel ring that
uses every rail sees it. The root keeps them; nothing else is gathered. Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from megatron_pipette.probe.budget import (
    SAFETY,
    BudgetPlan,
    RoundConfig,
    RoundCosts,
    all_to_all_reserve_s,
    choose_round,
)
from megatron_pipette.probe.schedule import ALL_TO_ALL_NODES, Round, all_to_all_peers, probe_rounds
from megatron_pipette.probe.transport import PairTimes, Transport

METRICS = ("small_s", "large_s", "exchange_medium_s", "exchange_large_s", "batched_medium_s", "batched_large_s")
"""What a round records per sender, in this order."""
AGREE = 3
"""Agreement values: the clock, the small part's and the large part's per-repeat wall time."""


@dataclass
class PhaseResult:
    """What one phase measured (kept on the root only)."""

    rounds: list[Round]
    """Every round of the phase, in the order they run."""
    configs: list[RoundConfig | None] = field(default_factory=list)
    """Per round, what was measured; None: skipped for the budget."""
    round_times_s: list[float] = field(default_factory=list)
    """Wall time of each round that ran (slowest rank)."""
    times: list[np.ndarray] = field(default_factory=list)
    """Per round that ran: (slots, len(METRICS)) of METRICS, slot = sending rank (intra) or node (inter)."""

    @property
    def measured(self) -> int:
        return sum(c is not None for c in self.configs)


@dataclass
class AllToAllResult:
    """What the all-to-all measured (kept on the root only)."""

    bytes_per_peer: int
    """What each rank sent to every peer, and received from it, in one all-to-all."""
    block_s: np.ndarray
    """(blocks, repeats) seconds of the slowest rank of each block in each timed all-to-all; NaN
    where a block sat out (a last block of one node)."""


@dataclass
class Measurements:
    """Everything the probe measured, on the root."""

    world_size: int
    gpus_per_node: int
    gemm_flops: np.ndarray
    """(N,) FLOP/s per rank."""
    copy_Bps: np.ndarray
    """(N,) bytes read + written per second per rank."""
    intra: PhaseResult
    inter: PhaseResult
    all_to_all: AllToAllResult | None = None
    """None with one node; no repeats where the budget left no time for it."""
    duration_s: float = 0.0

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.gpus_per_node


def _timed(times: PairTimes) -> np.ndarray:
    return np.column_stack([getattr(times, m) for m in METRICS])


class _Phase:
    """Runs the rounds of one phase within a deadline, re-pricing each round from the last."""

    def __init__(self, t: Transport, result: PhaseResult, *, deadline_s: float, repeats: int, num_slots: int,
                 bandwidth_first: bool, reserve: Callable[[RoundCosts, float], float] | None = None):
        self.t, self.result, self.deadline_s, self.repeats = t, result, deadline_s, repeats
        self.num_slots, self.bandwidth_first, self.reserve = num_slots, bandwidth_first, reserve
        self.costs: RoundCosts | None = None
        """The costs of the last round that ran, agreed: what the phase after it is priced from."""

    def _slots(self, rnd: Round) -> np.ndarray:
        """The result slot of each played rank: itself inside nodes, its node between nodes."""
        ranks = self.t.ranks
        return ranks if rnd.kind == "intra" else ranks // self.t.gpus_per_node

    def _agree(self, rnd: Round | None, times: PairTimes | None) -> tuple[float, float, float]:
        """One collective: the clock and costs (max over all ranks) and the last round's results."""
        t, n = self.t, len(self.t.ranks)
        agreed = np.column_stack([np.full(n, t.elapsed()), np.zeros((n, 2))])
        if times is not None:
            agreed[:, 1] = np.nan_to_num(times.small_wall_s)
            agreed[:, 2] = np.nan_to_num(times.large_wall_s)
        rows, slots = [np.pad(agreed, ((0, 0), (0, len(METRICS) - AGREE)))], [np.full(n, self.num_slots)]
        if rnd is not None:
            sent = _timed(times)
            keep = ~np.all(np.isnan(sent), axis=1)
            rows.append(np.where(np.isnan(sent[keep]), -np.inf, sent[keep]))
            slots.append(self._slots(rnd)[keep])
        table = t.gather_max(np.concatenate(slots), np.concatenate(rows), self.num_slots + 1)
        if rnd is not None and t.is_root:
            self.result.times.append(np.where(np.isinf(table[:-1]), np.nan, table[:-1]))
        return float(table[-1, 0]), float(table[-1, 1]), float(table[-1, 2])

    def run(self) -> None:
        t, rounds = self.t, self.result.rounds
        if not rounds:
            return
        # Calibration on the first round's pairs: one repeat of each size prices the rounds; it
        # stands as the first round's result should not even one more repeat fit the budget.
        start, _, _ = self._agree(None, None)
        first = rounds[0].partner_ranks(t.ranks, t.gpus_per_node)
        calibration = t.measure_pairs(first, repeats=1, large=True, warm_up=True)
        now, small, large = self._agree(None, calibration)
        costs = RoundCosts(overhead_s=max(now - start - small - large, 0.0), small_s=small, large_s=large)
        if self.reserve is not None:      # what a phase after this one needs, priced from the calibration
            self.deadline_s -= self.reserve(costs, self.deadline_s - now)
        for k, rnd in enumerate(rounds):
            config = choose_round(costs, time_left_s=self.deadline_s - now, rounds_left=len(rounds) - k,
                                  max_repeats=self.repeats, bandwidth_first=self.bandwidth_first)
            if config is None and k == 0:
                config, times = RoundConfig(1, True), calibration
            elif config is None:
                break
            else:
                partner = rnd.partner_ranks(t.ranks, t.gpus_per_node)
                times = t.measure_pairs(partner, repeats=config.repeats, large=config.large, warm_up=k > 0)
            prev = now
            now, small, large = self._agree(rnd, times)
            self.result.configs.append(config)
            self.result.round_times_s.append(now - prev)
            costs = _update(costs, config, now - prev, small, large)
        self.result.configs += [None] * (len(rounds) - len(self.result.configs))
        self.costs = costs


def _update(costs: RoundCosts, config: RoundConfig, period_s: float, t_small: float, t_large: float) -> RoundCosts:
    """Re-price a round from the one that just ran (slowest pair's per-repeat wall times, agreed)."""
    small = t_small if t_small > 0 else costs.small_s
    large = t_large if config.large and t_large > 0 else costs.large_s
    spent = config.repeats * (small + (large if config.large else 0.0))
    return RoundCosts(overhead_s=max(period_s - spent, 0.0), small_s=small, large_s=large)


def _all_to_all(t: Transport, costs: RoundCosts, *, deadline_s: float, repeats: int,
                large_bytes: int) -> AllToAllResult:
    """Up to `repeats` timed all-to-alls of every block at once, after an untimed one that sets up
    the connections to the new peers, each while the deadline allows it: the first priced as two
    of the inter-node rounds' large parts (each rank moves `large_bytes` either way, split over its
    peers, and connects to them), the next ones as the last one took. Each all-to-all ends with one
    agreement, the clock and every block's slowest rank."""
    num_nodes = t.world_size // t.gpus_per_node
    peers = all_to_all_peers(t.ranks, num_nodes, t.gpus_per_node)
    blocks = -(-num_nodes // ALL_TO_ALL_NODES)
    slots = np.concatenate([t.ranks // t.gpus_per_node // ALL_TO_ALL_NODES, np.full(t.ranks.size, blocks)])

    def agree(times: np.ndarray) -> tuple[float, float, np.ndarray]:
        """(clock, slowest rank's time, (blocks,) each block's slowest), max over every rank."""
        seconds = np.nan_to_num(times, nan=-np.inf)
        mine = np.column_stack([np.full(t.ranks.size, -np.inf), seconds])
        clock = np.column_stack([np.full(t.ranks.size, t.elapsed()), seconds])
        table = t.gather_max(slots, np.concatenate([mine, clock]), blocks + 1)
        return float(table[-1, 0]), float(table[-1, 1]), np.where(np.isinf(table[:-1, 1]), np.nan, table[:-1, 1])

    result = AllToAllResult(bytes_per_peer=large_bytes // peers.shape[1], block_s=np.empty((blocks, 0)))
    now, _, _ = agree(np.full(t.ranks.size, np.nan))
    if now + SAFETY * (costs.overhead_s + 2 * costs.large_s) > deadline_s:
        return result
    now, _, _ = agree(t.measure_all_to_all(peers, nbytes=result.bytes_per_peer))
    timed, period = [], costs.overhead_s + costs.large_s
    while len(timed) < repeats and now + SAFETY * period <= deadline_s:
        prev = now
        now, _, per_block = agree(t.measure_all_to_all(peers, nbytes=result.bytes_per_peer))
        timed.append(per_block)
        period = now - prev
    if timed and t.is_root:
        result.block_s = np.column_stack(timed)
    return result


def run_engine(t: Transport, plan: BudgetPlan, *, repeats: int, large_bytes: int,
               known_nodes: np.ndarray | None = None) -> Measurements | None:
    """Run the whole probe on `t` (collective); the measurements on the root, None elsewhere.
    `known_nodes` ((nodes,) bool, the same on every rank): nodes a probe measured before, whose pairs
    are not measured again (schedule.probe_rounds)."""
    n, gpn = t.world_size, t.gpus_per_node
    gemm, copy = t.compute(plan.gemm_window_s, plan.copy_window_s)
    table = t.gather_max(t.ranks, np.column_stack([gemm, copy]), n)
    intra_rounds, inter_rounds = probe_rounds(n // gpn, gpn, known_nodes)
    intra, inter = PhaseResult(intra_rounds), PhaseResult(inter_rounds)
    intra_deadline = plan.intra_deadline_s(t.elapsed(), len(intra_rounds), len(inter_rounds))
    _Phase(t, intra, deadline_s=intra_deadline, repeats=repeats, num_slots=n, bandwidth_first=False).run()
    nodes = n // gpn
    between = _Phase(t, inter, deadline_s=plan.p2p_deadline_s, repeats=repeats, num_slots=nodes, bandwidth_first=True,
                     reserve=lambda costs, left: all_to_all_reserve_s(costs, left, repeats))
    between.run()
    exchanged = None if nodes == 1 else _all_to_all(t, between.costs, deadline_s=plan.p2p_deadline_s,
                                                    repeats=repeats, large_bytes=large_bytes)
    if not t.is_root:
        return None
    return Measurements(world_size=n, gpus_per_node=gpn, gemm_flops=table[:, 0], copy_Bps=table[:, 1],
                        intra=intra, inter=inter, all_to_all=exchanged, duration_s=t.elapsed())
