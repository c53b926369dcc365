"""Which processes Megatron puts in one group once ranks are renumbered (torch-free).

The planner places logical ranks on physical processes (the ranks torchrun gave them);
`reinit.reinit_with_ranks` then gives each process its logical rank, and Megatron builds
its groups over logical ranks. This predicts the result in physical ranks, so a layout
can be checked against what the network looks like.
"""

from collections.abc import Sequence

import numpy as np

from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.ranks import RankGrid, dense_grid, expert_grid

GroupRanks = dict[str, list[int]]

DENSE_GROUPS = ("tp", "cp", "dp", "pp", "dp-cp")
"""The groups of the dense grid (spec.ranks), named as Megatron's order strings name them."""
EXPERT_GROUPS = ("ep", "etp", "edp")
"""The groups of the expert grid."""


def expected_groups(logical_to_physical: Sequence[int], *, tp: int, pp: int, dp: int, cp: int = 1,
                    ep: int = 1, etp: int | None = None) -> dict[int, GroupRanks]:
    """For each physical rank, the sorted physical ranks of each of its groups: "tp", "cp", "dp"
    (without context parallelism, Megatron's get_data_parallel_group()), "pp", "dp-cp" (the dense
    gradients' group) and the expert grid's "ep", "etp" and "edp" (Megatron builds them for a
    dense model too).

    `logical_to_physical[r]` is the physical (torchrun) rank that runs logical rank r; `etp`
    None is Megatron's default, the tensor-parallel size.
    """
    physical, grids = _grids(logical_to_physical, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp)
    groups: dict[int, GroupRanks] = {int(p): {} for p in physical}
    for grid, kinds in grids:
        for kind in kinds:
            for row in _rows(physical, grid, kind).tolist():
                for member in row:
                    groups[member][kind] = row
    return groups


def distinct_groups(logical_to_physical: Sequence[int], kind: str, *, tp: int, pp: int, dp: int, cp: int = 1,
                    ep: int = 1, etp: int | None = None) -> list[list[int]]:
    """Every group of one kind (as in `expected_groups`), each sorted, in physical ranks."""
    physical, grids = _grids(logical_to_physical, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp)
    grid, kinds = next((grid, kinds) for grid, kinds in grids if kind in kinds)
    return _rows(physical, grid, kind).tolist()


def group_sizes(layout: Layout) -> dict[str, int | None]:
    """The sizes `expected_groups` takes, from a layout."""
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "cp": layout.cp,
            "ep": layout.ep, "etp": layout.expert_tensor_parallel_size}


def _grids(logical_to_physical: Sequence[int], *, tp: int, pp: int, dp: int, cp: int, ep: int,
           etp: int | None) -> tuple[np.ndarray, list[tuple[RankGrid, tuple[str, ...]]]]:
    """The checked permutation, and the dense and the expert grid with their group kinds."""
    world = tp * cp * dp * pp
    physical = np.asarray(logical_to_physical)
    if sorted(physical.tolist()) != list(range(world)):
        raise ValueError(f"logical_to_physical must be a permutation of range({world}) for tp={tp} cp={cp} "
                         f"dp={dp} pp={pp}, got {list(logical_to_physical)}")
    experts = expert_grid(world, etp=tp if etp is None else etp, ep=ep, pp=pp)
    return physical, [(dense_grid(tp=tp, cp=cp, dp=dp, pp=pp), DENSE_GROUPS), (experts, EXPERT_GROUPS)]


def _rows(physical: np.ndarray, grid: RankGrid, group: str) -> np.ndarray:
    """(groups, group size): every `group` group of the grid in physical ranks, each sorted."""
    return np.sort(physical[grid.groups(group)], axis=1)
