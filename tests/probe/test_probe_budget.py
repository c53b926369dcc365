"""Budget split and per-round cuts: pure Python, no torch."""

import pytest

from megatron_pipette.probe.budget import (
    ALL_TO_ALL_SHARE,
    SAFETY,
    RoundConfig,
    RoundCosts,
    all_to_all_reserve_s,
    choose_round,
    plan_budget,
)


def test_plan_budget_fits_inside_the_budget():
    for budget in (0.5, 2, 30, 600):
        p = plan_budget(budget)
        assert p.gemm_window_s > 0 and p.copy_window_s > 0
        assert p.gemm_window_s + p.copy_window_s < p.p2p_deadline_s < budget
    with pytest.raises(ValueError):
        plan_budget(0)


def test_intra_node_rounds_get_a_share_by_count_and_pass_on_what_they_leave():
    p = plan_budget(30)
    assert p.intra_deadline_s(1.0, 7, 0) == p.p2p_deadline_s             # one node: all of it
    few = p.intra_deadline_s(1.0, 7, 1023)
    assert few == pytest.approx(1.0 + 0.2 * (p.p2p_deadline_s - 1.0))    # at least INTRA_MIN_SHARE
    assert p.intra_deadline_s(1.0, 7, 7) == pytest.approx(1.0 + 0.5 * (p.p2p_deadline_s - 1.0))


COSTS = RoundCosts(overhead_s=0.01, small_s=0.001, large_s=0.1)


def test_full_round_when_it_fits():
    assert choose_round(COSTS, time_left_s=100, rounds_left=10, max_repeats=5) == RoundConfig(5, True)


def test_cuts_repeats_first_then_the_large_message_then_rounds():
    # 10 rounds, 5 repeats of both sizes = 1.25 * 10 * (0.01 + 5 * 0.101) = 6.45 s; 3 repeats: 3.91 s
    assert choose_round(COSTS, time_left_s=4.0, rounds_left=10, max_repeats=5) == RoundConfig(3, True)
    assert choose_round(COSTS, time_left_s=0.6, rounds_left=10, max_repeats=5) == RoundConfig(5, False)
    assert choose_round(COSTS, time_left_s=0.12, rounds_left=10, max_repeats=5) == RoundConfig(1, False)
    assert choose_round(COSTS, time_left_s=0.005, rounds_left=10, max_repeats=5) is None


def test_bandwidth_first_cuts_rounds_before_the_large_message():
    # Between nodes a skipped pair is filled from the per-node fit, a pair without bandwidth is not.
    assert choose_round(COSTS, time_left_s=0.6, rounds_left=10, max_repeats=5,
                        bandwidth_first=True) == RoundConfig(1, True)
    assert choose_round(COSTS, time_left_s=0.12, rounds_left=10, max_repeats=5,
                        bandwidth_first=True) == RoundConfig(1, False)


def test_the_all_to_all_keeps_what_it_needs_and_at_most_its_share():
    costs = RoundCosts(overhead_s=0.01, small_s=0.001, large_s=0.05)
    assert all_to_all_reserve_s(costs, 30.0, 3) == pytest.approx(SAFETY * 5 * 0.06)
    assert all_to_all_reserve_s(costs, 1.0, 3) == pytest.approx(ALL_TO_ALL_SHARE * 1.0)
