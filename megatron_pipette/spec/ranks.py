"""Megatron's rank grid: the coordinates of each rank and the ranks of each group.

Megatron numbers ranks in the order `tp-cp-ep-dp-pp`, the first axis varying fastest
(megatron.core.parallel_state.RankGenerator), and builds two grids over the same world: the
dense layers' (tp, cp, dp, pp: ep is 1 there) and the experts' (etp, ep, edp, pp: cp is 1 there,
and its tensor- and data-parallel axes are the expert ones). A group is the set of ranks that
differ only along its axes, named as Megatron names them ("dp-cp": data and context parallel).
The groups the hook predicts, the links the communication model prices, the communicators the
memory model counts and the pipeline stages the placement search moves are all read from here.

Megatron's worked example (generate_masked_orthogonal_rank_groups): TP 2, DP 3, PP 4 in the
order tp-dp-pp; the data-parallel groups are

>>> grid = RankGrid(("tp", "dp", "pp"), (2, 3, 4))
>>> dp = grid.groups("dp").tolist()
>>> dp[0], dp[1], dp[7], len(dp)
([0, 2, 4], [1, 3, 5], [19, 21, 23], 8)

and initialize_model_parallel's: 16 GPUs, TP 2, PP 4 (so DP 2) in the default order:

>>> grid = dense_grid(tp=2, cp=1, dp=2, pp=4)
>>> grid.groups("dp").tolist()
[[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
>>> grid.groups("tp").tolist()
[[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
>>> grid.groups("pp").tolist()
[[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
>>> grid.rank(tp=1, dp=1, pp=2), grid.coordinates(11)
(11, {'tp': 1, 'cp': 0, 'dp': 1, 'pp': 2})
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DENSE_ORDER = ("tp", "cp", "dp", "pp")
"""Megatron's default order for the dense layers (tp-cp-ep-dp-pp with EP 1), fastest first."""
EXPERT_ORDER = ("etp", "ep", "edp", "pp")
"""The same order for the expert layers (CP 1; TP and DP are the expert ones)."""


@dataclass(frozen=True)
class RankGrid:
    """Axes, fastest first, and their sizes: a rank is the sum over axes of its coordinate times
    the product of the sizes of the axes before it."""

    axes: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.sizes) or len(set(self.axes)) != len(self.axes):
            raise ValueError(f"a rank grid names each axis once, with one size each: {self.axes} {self.sizes}")
        if min(self.sizes, default=1) < 1:
            raise ValueError(f"rank grid sizes must be positive: {dict(zip(self.axes, self.sizes))}")

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size(self, axis: str) -> int:
        return self.sizes[self.axes.index(axis)]

    def rank(self, **coordinates: int) -> int:
        """The rank at these coordinates (an axis left out is at 0)."""
        unknown = set(coordinates) - set(self.axes)
        if unknown:
            raise ValueError(f"no axis {sorted(unknown)} in the rank grid {self.axes}")
        return sum(coordinates.get(a, 0) * stride for a, stride in zip(self.axes, self._strides()))

    def coordinates(self, rank: int | np.ndarray) -> dict[str, int | np.ndarray]:
        """The coordinate of `rank` (or of each of an array of ranks) along every axis."""
        return {a: rank // stride % size for a, size, stride in zip(self.axes, self.sizes, self._strides())}

    def array(self, *dims: str) -> np.ndarray:
        """Every rank, one array dimension per entry of `dims` (outermost first). An entry joining
        axes with '-' ("dp-cp") is one dimension indexed as Megatron orders a group's members: the
        axis earlier in the grid varies fastest, however the entry spells them. Each axis of the
        grid appears once, or not at all where its size is 1 (as in Megatron's order strings)."""
        parts = [self._axes_of(d) for d in dims]
        named = [a for part in parts for a in part]
        left = [a for a in self.axes if a not in named]
        if len(set(named)) != len(named) or any(self.size(a) > 1 for a in left):
            raise ValueError(f"{dims} must name each axis of the rank grid {dict(zip(self.axes, self.sizes))} "
                             "larger than 1 once")
        slowest_first = self.axes[::-1]
        ranks = np.arange(self.world_size).reshape([self.size(a) for a in slowest_first])
        ranks = ranks.transpose([slowest_first.index(a) for a in named + left])
        return ranks.reshape([math.prod(self.size(a) for a in part) for part in parts])

    def groups(self, group: str) -> np.ndarray:
        """(number of groups, group size): every group along the axes of `group` ("tp", "dp-cp"),
        groups and members in the order of RankGenerator.get_ranks(group)."""
        along = self._axes_of(group)
        others = [a for a in self.axes[::-1] if a not in along]
        return self.array(*others, group).reshape(-1, math.prod(self.size(a) for a in along))

    def group_of(self, rank: int, group: str) -> np.ndarray:
        """The members of the `group` group that holds `rank`, in Megatron's order (built from
        the group's axes alone, so a large world costs no more than a small one)."""
        at, stride = self.coordinates(rank), dict(zip(self.axes, self._strides()))
        members = np.asarray(rank - sum(at[a] * stride[a] for a in self._axes_of(group)))
        for a in self._axes_of(group):      # slowest first: the last axis added varies fastest
            members = np.add.outer(members, np.arange(self.size(a)) * stride[a])
        return members.ravel()

    def _axes_of(self, group: str) -> list[str]:
        """The axes of a dimension or group, in the grid's order reversed (slowest first)."""
        along = group.split("-")
        unknown = set(along) - set(self.axes)
        if unknown or len(set(along)) != len(along):
            raise ValueError(f"{group!r} does not name distinct axes of the rank grid {self.axes}")
        return sorted(along, key=self.axes.index, reverse=True)

    def _strides(self) -> list[int]:
        return [math.prod(self.sizes[:i]) for i in range(len(self.sizes))]


def dense_grid(*, tp: int, cp: int, dp: int, pp: int) -> RankGrid:
    """The dense layers' grid in Megatron's default order."""
    return RankGrid(DENSE_ORDER, (tp, cp, dp, pp))


def expert_grid(world_size: int, *, etp: int, ep: int, pp: int) -> RankGrid:
    """The expert layers' grid over the same world: expert DP is what ETP x EP x PP leaves
    (parallel_state.initialize_model_parallel)."""
    if world_size % (etp * ep * pp):
        raise ValueError(f"expert grid etp={etp} ep={ep} pp={pp} does not divide the world of {world_size}")
    return RankGrid(EXPERT_ORDER, (etp, ep, world_size // (etp * ep * pp), pp))
