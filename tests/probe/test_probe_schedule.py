"""The circle-method tournament: pure Python, no torch."""

import subprocess
import sys
from itertools import combinations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_pipette.probe.schedule import partner_in, tournament


@given(st.integers(min_value=0, max_value=64))
def test_every_pair_exactly_once_each_rank_at_most_once_per_round(n):
    rounds = tournament(n)
    seen = [p for r in rounds for p in r]
    assert sorted(seen) == list(combinations(range(n), 2))
    for pairs in rounds:
        ranks = [x for p in pairs for x in p]
        assert len(ranks) == len(set(ranks))
        assert all(a < b for a, b in pairs)


@given(st.integers(min_value=2, max_value=64))
def test_round_count_and_sit_outs(n):
    rounds = tournament(n)
    if n % 2 == 0:
        assert len(rounds) == n - 1
        assert all(len(r) == n // 2 for r in rounds)
    else:
        assert len(rounds) == n
        sitting = [next(x for x in range(n) if partner_in(r, x) is None) for r in rounds]
        assert sorted(sitting) == list(range(n))   # each rank sits out exactly once


def test_small_cases_and_partner_lookup():
    assert tournament(0) == [] and tournament(1) == []
    assert tournament(2) == [[(0, 1)]]
    r = tournament(3)
    assert len(r) == 3 and all(len(p) == 1 for p in r)
    assert partner_in([(0, 3), (1, 2)], 2) == 1 and partner_in([(0, 3)], 1) is None


@pytest.mark.torchrun
def test_pure_parts_import_without_torch():
    code = ("import sys, megatron_pipette.probe.schedule, megatron_pipette.probe.budget, "
            "megatron_pipette.probe.document, megatron_pipette.report; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
