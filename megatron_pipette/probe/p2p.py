"""Point-to-point bandwidth and latency for every pair, as a round-robin tournament.

Why this shape: each round runs N/2 disjoint pairs at once, so links are
measured while the fabric carries the load it carries in training (every
device talking), and all pairs are covered in N-1 rounds (N for odd N).
Each pair times, `repeats` times each keeping the median, a small and a large
message one way in each direction (acknowledged by one byte, so the reverse
direction is idle) and concurrent two-way exchanges of a medium and the large
size: the one-way times give each direction's alpha-beta (document.alpha_beta),
the exchanges the alpha-beta a direction keeps while the other is busy, which
links that are not full duplex lower (1F1B's exchanges and ring collectives run
that way); the medium size, between the latency- and the bandwidth-bound ends,
is where such links lose most (medium_bytes). Rounds start with an agreement
all-reduce that is both the barrier and the budget check (budget.choose_round).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_pipette.probe.budget import RoundConfig, RoundCosts, choose_round
from megatron_pipette.probe.comm import Clock, agree_max, exchange, one_way
from megatron_pipette.probe.document import medium_bytes
from megatron_pipette.probe.schedule import partner_in, tournament


@dataclass(frozen=True)
class P2PResult:
    """This rank's medians per partner (NaN: not measured) and the agreed round plan."""

    small_s: list[float]
    """One-way small message to each partner (acknowledged)."""
    large_s: list[float]
    """One-way large message to each partner (acknowledged)."""
    exchange_s: list[float]
    """Large message both ways at once with each partner."""
    exchange_medium_s: list[float]
    """Medium message (medium_bytes) both ways at once with each partner."""
    configs: list[RoundConfig | None]
    """Per tournament round, what was measured; None: skipped for the budget. Identical on all ranks."""
    round_times_s: list[float]
    """Wall time of each round that ran (slowest rank), identical on all ranks."""


def measure_pairs(group: dist.ProcessGroup | None, device: torch.device, clock: Clock, *, deadline_s: float,
                  small_bytes: int, large_bytes: int, repeats: int, timeout: timedelta) -> P2PResult:
    """Run the tournament until done or until `deadline_s` (clock seconds) would be passed."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    rounds = tournament(n)
    nan = float("nan")
    small_s, large_s, exchange_s, exchange_medium_s = [nan] * n, [nan] * n, [nan] * n, [nan] * n
    configs: list[RoundConfig | None] = []
    round_times: list[float] = []
    if not rounds:
        return P2PResult(small_s, large_s, exchange_s, exchange_medium_s, configs, round_times)
    pair = _Pair(group, device, me, small_bytes, large_bytes, timeout)

    # Calibration on round 0's pairs: one warm-up (connection set-up, partner
    # sync), then one repeat of each size to price the first round.
    (start,) = agree_max(group, device, [clock.elapsed()])
    peer = partner_in(rounds[0], me)
    cal_small = cal_large = 0.0
    if peer is not None:
        pair.warm_up(peer)
        (small_s[peer], cal_small), (large_s[peer], exchange_medium_s[peer], exchange_s[peer], cal_large) = \
            pair.small(peer), pair.large(peer)
        # Kept as round 0's result should even one more repeat not fit the budget.
    now, cal_small, cal_large = agree_max(group, device, [clock.elapsed(), cal_small, cal_large])
    costs = RoundCosts(overhead_s=max(now - start - cal_small - cal_large, 0.0),
                       small_s=cal_small, large_s=cal_large)
    mine = (0.0, 0.0)

    for k, pairs in enumerate(rounds):
        if k > 0:
            prev = now
            now, t_small, t_large = agree_max(group, device, [clock.elapsed(), *mine])
            round_times.append(now - prev)
            costs = _update(costs, configs[-1], now - prev, t_small, t_large)
        config = choose_round(costs, time_left_s=deadline_s - now, rounds_left=len(rounds) - k,
                              max_repeats=repeats)
        if config is None and k == 0:
            configs.append(RoundConfig(1, True))   # the calibration repeat stands as round 0
            continue
        if config is None:
            break
        configs.append(config)
        mine = (0.0, 0.0)
        peer = partner_in(pairs, me)
        if peer is None:
            continue
        if k > 0:
            pair.warm_up(peer)   # lazy connection set-up, and starts both partners together
        smalls = [pair.small(peer) for _ in range(config.repeats)]
        small_s[peer] = statistics.median(t for t, _ in smalls)
        mine = (statistics.median(w for _, w in smalls), 0.0)
        if config.large:
            larges = [pair.large(peer) for _ in range(config.repeats)]
            large_s[peer], exchange_medium_s[peer], exchange_s[peer], wall = (statistics.median(column)
                                                                              for column in zip(*larges))
            mine = (mine[0], wall)

    if len(configs) == len(rounds):   # closing barrier, and the last round's time
        prev = now
        now, *_ = agree_max(group, device, [clock.elapsed(), *mine])
        round_times.append(now - prev)
    configs += [None] * (len(rounds) - len(configs))
    return P2PResult(small_s, large_s, exchange_s, exchange_medium_s, configs, round_times)


class _Pair:
    """One repeat of a pair's measurements; both partners call the same methods in the same order."""

    def __init__(self, group, device: torch.device, me: int, small_bytes: int, large_bytes: int,
                 timeout: timedelta):
        self.group, self.device, self.me, self.timeout = group, device, me, timeout
        self.small_buf = (torch.zeros(small_bytes, dtype=torch.uint8, device=device),
                          torch.empty(small_bytes, dtype=torch.uint8, device=device))
        self.large_buf = (torch.zeros(large_bytes, dtype=torch.uint8, device=device),
                          torch.empty(large_bytes, dtype=torch.uint8, device=device))
        medium = medium_bytes(small_bytes, large_bytes)
        self.medium_buf = (self.large_buf[0][:medium], self.large_buf[1][:medium])
        self.ack = torch.zeros(1, dtype=torch.uint8, device=device)

    def _both_ways(self, peer: int, bufs: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
        """(this rank's send to peer, wall time): the lower rank sends first, then the higher."""
        t0 = time.perf_counter()
        times = [one_way(self.group, self.device, peer, bufs[0] if sending else bufs[1], self.ack, sending,
                         self.timeout) for sending in ((self.me < peer), (self.me > peer))]
        return times[0] if self.me < peer else times[1], time.perf_counter() - t0

    def warm_up(self, peer: int) -> None:
        exchange(self.group, self.device, self.me, peer, *self.small_buf, self.timeout)

    def small(self, peer: int) -> tuple[float, float]:
        return self._both_ways(peer, self.small_buf)

    def large(self, peer: int) -> tuple[float, float, float, float]:
        """(one-way, medium exchange, large exchange, wall time)."""
        t0 = time.perf_counter()
        mine, _ = self._both_ways(peer, self.large_buf)
        medium = exchange(self.group, self.device, self.me, peer, *self.medium_buf, self.timeout)
        large = exchange(self.group, self.device, self.me, peer, *self.large_buf, self.timeout)
        return mine, medium, large, time.perf_counter() - t0


def _update(costs: RoundCosts, config: RoundConfig | None, period_s: float, t_small: float,
            t_large: float) -> RoundCosts:
    """Re-price a round from the one that just ran (slowest pair's per-repeat wall times, agreed)."""
    assert config is not None
    small = t_small if t_small > 0 else costs.small_s
    large = t_large if config.large and t_large > 0 else costs.large_s
    spent = config.repeats * (small + (large if config.large else 0.0))
    return RoundCosts(overhead_s=max(period_s - spent, 0.0), small_s=small, large_s=large)
