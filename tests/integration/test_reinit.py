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
    # Context parallel inside a node, experts across: the dense and expert grids differ.
    {"tp": 1, "pp": 1, "cp": 2, "ep": 2, "logical_of_physical": [0, 2, 1, 3]},
    # TP 2 with whole experts per rank (ETP 1), EP 2 spanning the TP pair.
    {"tp": 2, "pp": 1, "ep": 2, "etp": 1, "logical_of_physical": [1, 3, 0, 2]},
]
KINDS = ("tp", "pp", "dp", "cp", "dp-cp", "ep", "etp", "edp")


def test_inverse_mapping_helper() -> None:
    logical_to_physical = [2, 3, 0, 1]
    groups = expected_groups(logical_to_physical, tp=2, pp=2, dp=1)
    assert groups[2] == {"tp": [2, 3], "pp": [0, 2], "dp": [2], "cp": [2], "dp-cp": [2],
                         "ep": [2], "etp": [2, 3], "edp": [2]}
    assert groups[0]["tp"] == [0, 1] and groups[0]["pp"] == [0, 2] and groups[0]["dp"] == [0]


def test_context_and_expert_groups_by_hand() -> None:
    """tp2 cp2 dp2 on 8 ranks, identity placement: CP pairs ranks 2 apart, DP 4 apart; experts
    ep4 over etp2 (edp 1) span TP x CP x DP."""
    groups = expected_groups(list(range(8)), tp=2, pp=1, dp=2, cp=2, ep=4)
    assert groups[1]["cp"] == [1, 3] and groups[1]["dp"] == [1, 5] and groups[1]["dp-cp"] == [1, 3, 5, 7]
    assert groups[1]["ep"] == [1, 3, 5, 7] and groups[1]["etp"] == [0, 1] and groups[1]["edp"] == [1]


def test_expected_groups_rejects_non_permutation() -> None:
    with pytest.raises(ValueError, match="permutation"):
        expected_groups([0, 1, 1, 3], tp=2, pp=1, dp=2)


@pytest.mark.torchrun
def test_megatron_groups_follow_new_ranks(run_torchrun, tmp_path: Path) -> None:
    run_torchrun(WORKER, [str(tmp_path), json.dumps(CASES)], timeout=120)
    for case_index, case in enumerate(CASES):
        tp, pp, cp = case["tp"], case["pp"], case.get("cp", 1)
        dp = 4 // (tp * pp * cp)
        logical_to_physical = [0] * 4
        for physical, logical in enumerate(case["logical_of_physical"]):
            logical_to_physical[logical] = physical
        expected = expected_groups(logical_to_physical, tp=tp, pp=pp, dp=dp, cp=cp, ep=case.get("ep", 1),
                                   etp=case.get("etp"))
        for physical in range(4):
            got = json.loads((tmp_path / f"rank{physical}.json").read_text())[case_index]
            assert got["rank"] == case["logical_of_physical"][physical]
            for kind in KINDS:
                assert got[kind]["ranks"] == expected[physical][kind], (case, physical, kind)
                assert got[kind]["sum"] == sum(expected[physical][kind]), (case, physical, kind)
