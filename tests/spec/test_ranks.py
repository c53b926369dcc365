"""Megatron's rank grid (spec.ranks): its worked examples, its invariants, and megatron-core's own
RankGenerator group for group."""

import doctest
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pipette.spec import ranks
from megatron_pipette.spec.ranks import DENSE_ORDER, EXPERT_ORDER, RankGrid, dense_grid, expert_grid

# (tp, cp, dp, pp, ep, etp): context parallelism, experts wider and narrower than TP, ETP != TP.
GRIDS = [
    (1, 1, 1, 1, 1, 1),
    (2, 1, 3, 4, 1, 2),
    (2, 2, 2, 2, 4, 1),
    (4, 1, 4, 2, 2, 2),
    (1, 4, 2, 3, 8, 1),
    (8, 2, 1, 1, 4, 4),
    (2, 2, 4, 2, 2, 4),
]


def tokens(axes: tuple[str, ...]):
    """Every group a grid has: each non-empty set of its axes, spelled in Megatron's token form."""
    for n in range(1, len(axes) + 1):
        yield from ("-".join(c) for c in itertools.combinations(axes, n))


def test_worked_examples() -> None:
    result = doctest.testmod(ranks)
    assert result.attempted >= 8 and result.failed == 0


@pytest.mark.megatron
@pytest.mark.parametrize("tp,cp,dp,pp,ep,etp", GRIDS)
def test_groups_match_megatron_rank_generator(tp, cp, dp, pp, ep, etp) -> None:
    from megatron.core.parallel_state import RankGenerator

    world = tp * cp * dp * pp
    dense = dense_grid(tp=tp, cp=cp, dp=dp, pp=pp)
    experts = expert_grid(world, etp=etp, ep=ep, pp=pp)
    megatron_dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    megatron_experts = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1,
                                     order="tp-cp-ep-dp-pp")
    for token in tokens(DENSE_ORDER):
        assert dense.groups(token).tolist() == megatron_dense.get_ranks(token), token
    megatron_name = {"etp": "tp", "ep": "ep", "edp": "dp", "pp": "pp"}
    for token in tokens(EXPERT_ORDER):
        theirs = "-".join(megatron_name[a] for a in token.split("-"))
        assert experts.groups(token).tolist() == megatron_experts.get_ranks(theirs), token


sizes = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@settings(deadline=None)   # a 256-rank grid checks 15 kinds of group, row by row
@given(sizes)
def test_groups_differ_only_along_their_axes(grid_sizes: list[int]) -> None:
    """Each group's members share every other coordinate and cover its axes once; the groups of
    one kind partition the world; rank and coordinates are inverse."""
    grid = RankGrid(tuple("abcd"[:len(grid_sizes)]), tuple(grid_sizes))
    everyone = np.arange(grid.world_size)
    assert [grid.rank(**grid.coordinates(r)) for r in everyone.tolist()] == everyone.tolist()
    for token in tokens(grid.axes):
        along = token.split("-")
        rows = grid.groups(token)
        assert sorted(rows.ravel().tolist()) == everyone.tolist()
        for row in rows:
            at = grid.coordinates(row)
            assert all(np.all(at[a] == at[a][0]) for a in grid.axes if a not in along)
            assert len({tuple(at[a][i] for a in along) for i in range(row.size)}) == row.size
            assert np.array_equal(grid.group_of(int(row[-1]), token), row)


def test_array_indexes_by_coordinates() -> None:
    grid = dense_grid(tp=2, cp=3, dp=2, pp=2)
    by = grid.array("pp", "dp-cp", "tp")
    assert by.shape == (2, 6, 2)
    for pp, dp, cp, tp in itertools.product(range(2), range(2), range(3), range(2)):
        assert by[pp, dp * 3 + cp, tp] == grid.rank(tp=tp, cp=cp, dp=dp, pp=pp)
    assert np.array_equal(grid.array("pp", "cp-dp", "tp"), by)


@pytest.mark.parametrize("dims", [("tp", "dp"), ("tp", "cp", "dp", "pp", "tp"), ("tp-cp-dp-pp-ep",)])
def test_array_names_every_axis_once(dims) -> None:
    with pytest.raises(ValueError, match="rank grid"):
        dense_grid(tp=2, cp=1, dp=2, pp=2).array(*dims)


def test_array_may_leave_out_axes_of_size_one() -> None:
    grid = dense_grid(tp=2, cp=1, dp=3, pp=1)
    assert grid.array("dp", "tp").tolist() == grid.array("pp", "dp", "cp", "tp").reshape(3, 2).tolist()


def test_expert_grid_must_divide_the_world() -> None:
    with pytest.raises(ValueError, match="etp=2 ep=3 pp=1 does not divide the world of 8"):
        expert_grid(8, etp=2, ep=3, pp=1)
