"""Which processes Megatron puts in one group once ranks are renumbered (torch-free).

The planner places logical ranks on physical processes (the ranks torchrun gave them);
`reinit.reinit_with_ranks` then gives each process its logical rank, and Megatron builds
its groups over logical ranks. This predicts the result in physical ranks, so a layout
can be checked against what the network looks like.
"""

from collections.abc import Sequence

# Megatron's default order (megatron.core.parallel_state.RankGenerator, 'tp-cp-ep-dp-pp'),
# with cp = ep = 1: logical rank = tp_rank + tp * (dp_rank + dp * pp_rank).
GroupRanks = dict[str, list[int]]


def logical_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    """The logical rank of the process at (tp_rank, dp_rank, pp_rank)."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def expected_groups(
    tp: int, pp: int, dp: int, logical_to_physical: Sequence[int]
) -> dict[int, GroupRanks]:
    """For each physical rank, the sorted physical ranks of its "tp", "pp" and "dp" groups.

    `logical_to_physical[r]` is the physical (torchrun) rank that runs logical rank r.
    """
    world = tp * pp * dp
    if sorted(logical_to_physical) != list(range(world)):
        raise ValueError(
            f"logical_to_physical must be a permutation of range({world}) for "
            f"tp={tp} pp={pp} dp={dp}, got {list(logical_to_physical)}"
        )

    def physical(ranks: list[int]) -> list[int]:
        return sorted(logical_to_physical[r] for r in ranks)

    groups: dict[int, GroupRanks] = {}
    for pp_rank in range(pp):
        for dp_rank in range(dp):
            for tp_rank in range(tp):
                me = logical_to_physical[logical_rank(tp_rank, dp_rank, pp_rank, tp, dp)]
                groups[me] = {
                    "tp": physical([logical_rank(t, dp_rank, pp_rank, tp, dp) for t in range(tp)]),
                    "pp": physical([logical_rank(tp_rank, dp_rank, p, tp, dp) for p in range(pp)]),
                    "dp": physical([logical_rank(tp_rank, d, pp_rank, tp, dp) for d in range(dp)]),
                }
    return groups
