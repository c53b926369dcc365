"""Point-to-point bandwidth and latency for every pair, as a round-robin tournament.

Why this shape: each round runs N/2 disjoint pairs at once, so links are
measured while the fabric carries the load it carries in training (every
device talking), and all pairs are covered in N-1 rounds (N for odd N).
Each pair times concurrent bidirectional exchanges at a small and a large
size, `repeats` times each, keeping the median; rank 0 later fits
alpha-beta (document.alpha_beta). Rounds start with an agreement all-reduce
that is both the barrier and the budget check (budget.choose_round).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_pipette.probe.budget import RoundConfig, RoundCosts, choose_round
from megatron_pipette.probe.comm import Clock, agree_max, exchange
from megatron_pipette.probe.schedule import partner_in, tournament


@dataclass(frozen=True)
class P2PResult:
    """This rank's medians per partner (NaN: not measured) and the agreed round plan."""

    small_s: list[float]
    large_s: list[float]
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
    small_s, large_s = [nan] * n, [nan] * n
    configs: list[RoundConfig | None] = []
    round_times: list[float] = []
    if not rounds:
        return P2PResult(small_s, large_s, configs, round_times)

    small = (torch.zeros(small_bytes, dtype=torch.uint8, device=device),
             torch.empty(small_bytes, dtype=torch.uint8, device=device))
    large = (torch.zeros(large_bytes, dtype=torch.uint8, device=device),
             torch.empty(large_bytes, dtype=torch.uint8, device=device))

    def swap(peer: int, bufs: tuple[torch.Tensor, torch.Tensor]) -> float:
        return exchange(group, device, me, peer, bufs[0], bufs[1], timeout)

    # Calibration on round 0's pairs: one warm-up (connection set-up, partner
    # sync), then one exchange of each size to price the first round.
    (start,) = agree_max(group, device, [clock.elapsed()])
    peer = partner_in(rounds[0], me)
    cal_small = cal_large = 0.0
    if peer is not None:
        swap(peer, small)
        cal_small, cal_large = swap(peer, small), swap(peer, large)
        # Kept as round 0's result should even one more exchange not fit the budget.
        small_s[peer], large_s[peer] = cal_small, cal_large
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
            configs.append(RoundConfig(1, True))   # the calibration exchanges stand as round 0
            continue
        if config is None:
            break
        configs.append(config)
        mine = (0.0, 0.0)
        peer = partner_in(pairs, me)
        if peer is None:
            continue
        if k > 0:
            swap(peer, small)   # warm-up: lazy connection set-up, and starts both partners together
        small_s[peer] = statistics.median(swap(peer, small) for _ in range(config.repeats))
        if config.large:
            large_s[peer] = statistics.median(swap(peer, large) for _ in range(config.repeats))
        mine = (small_s[peer], large_s[peer] if config.large else 0.0)

    if len(configs) == len(rounds):   # closing barrier, and the last round's time
        prev = now
        now, *_ = agree_max(group, device, [clock.elapsed(), *mine])
        round_times.append(now - prev)
    configs += [None] * (len(rounds) - len(configs))
    return P2PResult(small_s, large_s, configs, round_times)


def _update(costs: RoundCosts, config: RoundConfig | None, period_s: float, t_small: float,
            t_large: float) -> RoundCosts:
    """Re-price a round from the one that just ran (slowest pair's medians, agreed)."""
    assert config is not None
    small = t_small if t_small > 0 else costs.small_s
    large = t_large if config.large and t_large > 0 else costs.large_s
    spent = config.repeats * (small + (large if config.large else 0.0))
    return RoundCosts(overhead_s=max(period_s - spent, 0.0), small_s=small, large_s=large)
