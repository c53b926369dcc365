"""Budget split and per-round cuts: pure Python, no torch."""

import pytest

from megatron_pipette.probe.budget import (RoundConfig, RoundCosts, affordable_repeats, choose_round,
                                           plan_budget)


def test_plan_budget_fits_inside_the_budget():
    for budget in (0.5, 2, 30, 600):
        p = plan_budget(budget, with_collectives=True)
        assert 0 < p.gemm_window_s and 0 < p.copy_window_s
        assert p.gemm_window_s + p.copy_window_s < p.p2p_deadline_s < p.collectives_deadline_s < budget
    assert plan_budget(30, with_collectives=False).p2p_deadline_s == plan_budget(30, with_collectives=False
                                                                                 ).collectives_deadline_s
    with pytest.raises(ValueError):
        plan_budget(0, with_collectives=True)


COSTS = RoundCosts(overhead_s=0.01, small_s=0.001, large_s=0.1)


def test_full_round_when_it_fits():
    assert choose_round(COSTS, time_left_s=100, rounds_left=10, max_repeats=5) == RoundConfig(5, True)


def test_cuts_repeats_first_then_the_large_message_then_rounds():
    # 10 rounds, 5 repeats of both sizes = 1.25 * 10 * (0.01 + 5 * 0.101) = 6.45 s; 3 repeats: 3.91 s
    assert choose_round(COSTS, time_left_s=4.0, rounds_left=10, max_repeats=5) == RoundConfig(3, True)
    assert choose_round(COSTS, time_left_s=0.6, rounds_left=10, max_repeats=5) == RoundConfig(5, False)
    assert choose_round(COSTS, time_left_s=0.12, rounds_left=10, max_repeats=5) == RoundConfig(1, False)
    assert choose_round(COSTS, time_left_s=0.005, rounds_left=10, max_repeats=5) is None


def test_affordable_repeats():
    assert affordable_repeats(0.1, time_left_s=0.40, max_repeats=5) == 3
    assert affordable_repeats(0.1, time_left_s=-1, max_repeats=5) == 0
    assert affordable_repeats(0.0, time_left_s=1, max_repeats=5) == 5
