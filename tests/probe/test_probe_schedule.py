"""Tournaments inside and between nodes: pure, no torch."""

import subprocess
import sys
from itertools import combinations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_pipette.probe.schedule import (
    ALL_TO_ALL_NODES,
    CROSS_RAIL_ROUNDS,
    all_to_all_peers,
    partner_in,
    probe_rounds,
    round_partners,
    rounds_in_tournament,
    tournament,
)


@given(st.integers(min_value=0, max_value=64))
def test_every_pair_exactly_once_each_player_at_most_once_per_round(n):
    rounds = tournament(n)
    seen = [p for r in rounds for p in r]
    assert sorted(seen) == list(combinations(range(n), 2))
    for pairs in rounds:
        players = [x for p in pairs for x in p]
        assert len(players) == len(set(players))
        assert all(a < b for a, b in pairs)


@given(st.integers(min_value=2, max_value=64))
def test_round_count_and_sit_outs(n):
    rounds = tournament(n)
    assert len(rounds) == rounds_in_tournament(n)
    if n % 2 == 0:
        assert len(rounds) == n - 1
        assert all(len(r) == n // 2 for r in rounds)
    else:
        assert len(rounds) == n
        sitting = [next(x for x in range(n) if partner_in(r, x) is None) for r in rounds]
        assert sorted(sitting) == list(range(n))   # each sits out exactly once


def test_small_cases_and_partner_lookup():
    assert tournament(0) == [] and tournament(1) == []
    assert tournament(2) == [[(0, 1)]]
    assert round_partners(3, 0).tolist().count(-1) == 1
    assert partner_in([(0, 3), (1, 2)], 2) == 1 and partner_in([(0, 3)], 1) is None


@given(st.integers(1, 9), st.integers(1, 8))
def test_probe_rounds_pair_ranks_rail_to_rail_and_cover_every_node_pair(nodes, gpn):
    intra, inter = probe_rounds(nodes, gpn)
    ranks = np.arange(nodes * gpn)
    met = set()
    for rnd in intra:
        p = rnd.partner_ranks(ranks, gpn)
        has = p >= 0
        assert np.all(p[p[has]] == ranks[has])                       # mutual
        assert np.all(p[has] // gpn == ranks[has] // gpn)            # inside the node
    for rnd in inter:
        p = rnd.partner_ranks(ranks, gpn)
        has = p >= 0
        assert np.all(p[p[has]] == ranks[has])
        assert np.all(p[has] // gpn != ranks[has] // gpn)            # between nodes
        same_rail = p[has] % gpn == ranks[has] % gpn
        assert same_rail.all() if rnd.kind == "inter" else (gpn == 1 or not same_rail.any())
        if rnd.kind == "inter":
            met |= {(int(a) // gpn, int(b) // gpn) for a, b in zip(ranks[has], p[has])}
    assert met == {(a, b) for a in range(nodes) for b in range(nodes) if a != b}
    assert sum(r.kind == "cross_rail" for r in inter) == (min(CROSS_RAIL_ROUNDS, len(tournament(nodes)))
                                                           if gpn > 1 else 0)


def test_a_prefix_of_the_inter_node_rounds_spreads_partners():
    # Any k rounds give every node k distinct partners (each round is a perfect matching); the
    # spread order keeps them from being mirror-image neighbours only.
    _, inter = probe_rounds(64, 1)
    partners = np.stack([r.partner for r in inter[:4]])
    assert all(len(set(partners[:, k])) == 4 for k in range(64))
    assert np.median(np.abs(partners - np.arange(64))) > 8


@pytest.mark.torchrun
def test_pure_parts_import_without_torch():
    code = ("import sys, megatron_pipette.probe.schedule, megatron_pipette.probe.budget, "
            "megatron_pipette.probe.engine, megatron_pipette.probe.fit, megatron_pipette.probe.document, "
            "megatron_pipette.probe.twin, megatron_pipette.report; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@given(st.integers(min_value=1, max_value=11), st.integers(min_value=1, max_value=8))
def test_all_to_all_peers_are_every_rank_of_the_block_on_other_nodes_and_mutual(nodes, gpn):
    ranks = np.arange(nodes * gpn)
    peers = all_to_all_peers(ranks, nodes, gpn)
    assert peers.shape == (ranks.size, (ALL_TO_ALL_NODES - 1) * gpn)
    for r in ranks:
        mine = peers[r][peers[r] >= 0]
        block = [q for q in ranks
                 if q // gpn // ALL_TO_ALL_NODES == r // gpn // ALL_TO_ALL_NODES and q // gpn != r // gpn]
        assert sorted(mine.tolist()) == block                      # each once, none on its own node
        assert all(r in peers[q] for q in mine)                     # mutual
    # a full block fills the row: (ALL_TO_ALL_NODES - 1) x gpn peers, the padding only after them
    assert all((row >= 0).sum() == len(row) or np.all(row[(row >= 0).sum():] < 0) for row in peers)
    if nodes >= ALL_TO_ALL_NODES:
        assert (peers[:gpn * ALL_TO_ALL_NODES] >= 0).all()


def test_a_lone_last_node_sits_out_of_the_all_to_all():
    peers = all_to_all_peers(np.arange(10), 5, 2)
    assert (peers[8:] < 0).all() and (peers[:8] >= 0).any(axis=1).all()
