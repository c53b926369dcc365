"""summarize / write_heatmap on a synthetic two-node document."""

import pytest

from megatron_pipette.errors import PipetteError
from megatron_pipette.report import summarize, write_heatmap
from megatron_pipette.spec.cluster_file import cluster_to_json
from megatron_pipette.spec.hardware import preset_cluster


def synthetic_doc() -> dict:
    cluster = preset_cluster("dgx-h100", num_nodes=2)
    doc = cluster_to_json(cluster)
    doc["devices"][5]["gemm_flops"] *= 0.5                  # a straggler
    doc["bandwidth_Bps"][3][12] = doc["bandwidth_Bps"][12][3] = 1e9   # a bad inter-node link
    doc["collectives"] = [{"op": "all_reduce", "ranks": [0, 1], "bytes": 2**26, "time_s": 4e-4,
                           "busbw_Bps": 1.7e11}]
    doc["probe"] = {"backend": "nccl", "duration_s": 4.2, "budget_s": 30, "rounds": 15, "rounds_measured": 14,
                    "skipped": [{"what": "rounds", "rounds": [14], "pairs": [[0, 1]],
                                 "reason": "budget: 1 of 15 rounds not run"}]}
    return doc


def test_summarize_names_the_weak_spots():
    text = summarize(synthetic_doc())
    assert "16 devices, 2 node(s) x 8 (H100-80GB)" in text
    assert "slowest device: rank 5" in text
    assert "stragglers (below 80% of the median): rank 5" in text
    links = text.split("Slowest links")[1].splitlines()
    assert "3 <-> 12" in links[1] and "inter-node" in links[1]
    assert "node 1 (node1): intra" in text
    assert "TP 2:" in text
    assert "budget: 1 of 15 rounds not run" in text


def test_summarize_is_pure_and_rejects_non_cluster_documents():
    doc = synthetic_doc()
    before = repr(doc)
    summarize(doc)
    assert repr(doc) == before
    with pytest.raises(PipetteError, match="not a megatron-pipette cluster file"):
        summarize({"schema": "other"})


def test_heatmap_png(tmp_path):
    out = tmp_path / "bw.png"
    write_heatmap(synthetic_doc(), out)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000
    assert [p.name for p in tmp_path.iterdir()] == ["bw.png"]      # no temporary left behind
    with pytest.raises(PipetteError, match="cannot write"):
        write_heatmap(synthetic_doc(), tmp_path / "missing" / "bw.png")
