"""How the probe splits its time budget, and how it cuts work to stay inside it.

Why: a probe run inside a training job spends GPU-hours of the whole job, so it
must end when the caller said, at any scale. The compute check runs for fixed
windows (a share of the budget); the intra-node rounds get a share of the rest
by their count (at least INTRA_MIN_SHARE), the inter-node rounds what is left
but what the all-to-all after them needs (`all_to_all_reserve_s`, with two nodes
or more), and each phase re-plans every round from the costs measured so far (cutting
repeats first, then the large message, then whole rounds). Every input to a
decision is agreed across ranks (all-reduce MAX) before it is used, so all
ranks take the same decision without talking again. Pure Python: unit-tested
without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Shares of the budget (seconds are clamped to the bounds below).
COMPUTE_SHARE = 0.10
COMPUTE_MIN_S, COMPUTE_MAX_S = 0.04, 1.0
GEMM_FRACTION = 0.6          # of the compute slice; the rest times the memory copy
FINAL_SHARE = 0.05           # gather, build, validate, write, broadcast
INTRA_MIN_SHARE = 0.2        # of the point-to-point time, when there are inter-node rounds too
ALL_TO_ALL_SHARE = 0.1       # at most, of the inter-node time, what the all-to-all after it keeps
FINAL_MIN_S, FINAL_MAX_S = 0.05, 5.0
SAFETY = 1.25
"""Estimated costs are inflated by this factor before they are compared with the time left:
timings on a loaded machine drift, and running over the budget is worse than measuring less."""


@dataclass(frozen=True)
class BudgetPlan:
    """Deadlines in seconds since the probe's start (after its first barrier)."""

    budget_s: float
    gemm_window_s: float
    copy_window_s: float
    p2p_deadline_s: float

    def intra_deadline_s(self, now_s: float, intra_rounds: int, inter_rounds: int) -> float:
        """End of the intra-node phase starting at `now_s`: a share of the point-to-point time by
        round count; time it leaves unused passes to the inter-node rounds."""
        if inter_rounds == 0:
            return self.p2p_deadline_s
        share = max(INTRA_MIN_SHARE, intra_rounds / (intra_rounds + inter_rounds))
        return now_s + share * max(0.0, self.p2p_deadline_s - now_s)


def plan_budget(budget_s: float) -> BudgetPlan:
    """Split `budget_s` into the compute windows and the point-to-point deadline."""
    if not (isinstance(budget_s, (int, float)) and math.isfinite(budget_s) and budget_s > 0):
        raise ValueError(f"budget must be a positive number of seconds, got {budget_s!r}")
    compute = min(max(COMPUTE_SHARE * budget_s, COMPUTE_MIN_S), COMPUTE_MAX_S)
    final = min(max(FINAL_SHARE * budget_s, FINAL_MIN_S), FINAL_MAX_S)
    return BudgetPlan(budget_s=float(budget_s), gemm_window_s=GEMM_FRACTION * compute,
                      copy_window_s=(1 - GEMM_FRACTION) * compute, p2p_deadline_s=budget_s - final)


@dataclass(frozen=True)
class RoundConfig:
    """What one tournament round measures: `repeats` exchanges of each size used."""

    repeats: int
    large: bool


@dataclass(frozen=True)
class RoundCosts:
    """Agreed (slowest-rank) costs, seconds: per-round overhead and one exchange of each size."""

    overhead_s: float
    small_s: float
    large_s: float

    def round_s(self, config: RoundConfig) -> float:
        """Estimated wall time of one round, with the SAFETY margin."""
        per = self.small_s + (self.large_s if config.large else 0.0)
        return SAFETY * (self.overhead_s + config.repeats * per)


def choose_round(costs: RoundCosts, *, time_left_s: float, rounds_left: int, max_repeats: int,
                 bandwidth_first: bool = False) -> RoundConfig | None:
    """The richest round that lets every remaining round fit in `time_left_s`.

    Preference: full repeats with both sizes; fewer repeats; then the small
    message alone (bandwidth for those pairs is then filled in, see
    probe.fit). When not even the cheapest round fits for all remaining rounds,
    run the cheapest one while it alone still fits (later rounds will be
    skipped), and return None once it does not. With `bandwidth_first` (the
    inter-node rounds, whose skipped pairs a per-node fit fills in) rounds are
    cut before the large message: one repeat of both sizes while it fits.
    """
    assert rounds_left >= 1 and max_repeats >= 1
    for large in (True, False):
        for repeats in range(max_repeats, 0, -1):
            config = RoundConfig(repeats, large)
            if rounds_left * costs.round_s(config) <= time_left_s:
                return config
        if bandwidth_first and large and costs.round_s(RoundConfig(1, True)) <= time_left_s:
            return RoundConfig(1, True)
    cheapest = RoundConfig(1, False)
    return cheapest if costs.round_s(cheapest) <= time_left_s else None


def all_to_all_reserve_s(costs: RoundCosts, time_left_s: float, repeats: int) -> float:
    """What the inter-node rounds keep for the all-to-all after them (probe.engine), priced from
    their calibration: its untimed first one as two large parts, then `repeats` timed ones as one
    each, every one with a round's overhead and the SAFETY margin; at most ALL_TO_ALL_SHARE of the
    `time_left_s`, so that on a slow fabric the node pairs keep most of it."""
    return min(SAFETY * (repeats + 2) * (costs.overhead_s + costs.large_s), ALL_TO_ALL_SHARE * time_left_s)
