"""Renumbered ranks put Megatron's groups exactly on the predicted torchrun processes."""

import json
from pathlib import Path

import pytest

from megatron_pipette.integration.groups import expected_groups

WORKER = Path(__file__).with_name("reinit_worker.py")

# Four processes as two "nodes" of two: {0, 1} and {2, 3}.
CASES = [
    # Swap the nodes: logical ranks 0, 1 run on processes 2, 3 and vice versa.
    {"tp": 2, "pp": 2, "logical_of_physical": [2, 3, 0, 1]},
    # TP across the nodes, DP inside them.
    {"tp": 2, "pp": 1, "logical_of_physical": [0, 2, 1, 3]},
    # An arbitrary permutation, PP inside a node.
    {"tp": 1, "pp": 2, "logical_of_physical": [3, 1, 0, 2]},
]


def test_inverse_mapping_helper() -> None:
    logical_to_physical = [2, 3, 0, 1]
    groups = expected_groups(2, 2, 1, logical_to_physical)
    assert groups[2] == {"tp": [2, 3], "pp": [0, 2], "dp": [2]}
    assert groups[0] == {"tp": [0, 1], "pp": [0, 2], "dp": [0]}


def test_expected_groups_rejects_non_permutation() -> None:
    with pytest.raises(ValueError, match="permutation"):
        expected_groups(2, 1, 2, [0, 1, 1, 3])


@pytest.mark.torchrun
def test_megatron_groups_follow_new_ranks(run_torchrun, tmp_path: Path) -> None:
    run_torchrun(WORKER, [str(tmp_path), json.dumps(CASES)], timeout=120)
    for case_index, case in enumerate(CASES):
        tp, pp = case["tp"], case["pp"]
        dp = 4 // (tp * pp)
        logical_to_physical = [0] * 4
        for physical, logical in enumerate(case["logical_of_physical"]):
            logical_to_physical[logical] = physical
        expected = expected_groups(tp, pp, dp, logical_to_physical)
        for physical in range(4):
            got = json.loads((tmp_path / f"rank{physical}.json").read_text())[case_index]
            assert got["rank"] == case["logical_of_physical"][physical]
            for kind in ("tp", "pp", "dp"):
                assert got[kind]["ranks"] == expected[physical][kind], (case, physical, kind)
                assert got[kind]["sum"] == sum(expected[physical][kind]), (case, physical, kind)
