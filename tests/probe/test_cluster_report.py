"""summarize / write_heatmap on a synthetic two-node document."""

import pytest

from megatron_pipette.errors import PipetteError
from megatron_pipette.report import summarize, write_heatmap
from megatron_pipette.spec.cluster_file import ClusterFile, cluster_to_json
from megatron_pipette.spec.hardware import preset_cluster


def synthetic_doc() -> dict:
    cluster = preset_cluster("dgx-h100", num_nodes=4)
    doc = cluster_to_json(cluster)
    doc["devices"]["gemm_flops"][13] *= 0.5                 # a straggler: node 1, local 5
    inter = doc["inter_node"]["bandwidth_Bps"]
    inter[0][3] = inter[3][0] = 1e9                         # a bad node pair
    doc["probe"] = {"backend": "nccl", "duration_s": 4.2, "budget_s": 30, "intra_rounds": 7,
                    "intra_rounds_measured": 7, "inter_rounds": 3, "inter_rounds_measured": 2,
                    "slow_links": [{"nodes": [0, 3], "reason": "node 0 -> node 3: 1 GB/s, 2% of the fit"}],
                    "skipped": [{"what": "inter_rounds", "rounds": [2], "reason": "budget: 1 of 3 rounds not run"}]}
    return doc


def test_summarize_names_the_weak_spots():
    text = summarize(ClusterFile.from_json(synthetic_doc()))
    assert "32 devices, 4 node(s) x 8 (H100-80GB)" in text
    assert "slowest device: rank 13 (node1, local 5)" in text
    assert "stragglers (below 80% of the median): rank 13" in text
    pairs = text.split("slowest node pairs:")[1].splitlines()
    assert "node 0 (node0) <-> node 3 (node3)" in pairs[1] and "1 GB/s" in pairs[1]
    weakest = text.split("weakest nodes")[1].splitlines()[0]
    assert weakest.index("node 0") < weakest.index("node 1") and weakest.index("node 3") < weakest.index("node 1")
    assert "7 of 7 intra-node and 2 of 3 inter-node rounds" in text
    assert "node 0 -> node 3: 1 GB/s" in text
    assert "budget: 1 of 3 rounds not run" in text
    assert "all-to-alls between NVLink domains get 100% of their links' rate (assumed)" in text
    doc = synthetic_doc()
    doc["inter_node"]["all_to_all_bandwidth_factor"] = 0.7
    doc["probe"]["all_to_all"] = {"nodes_per_block": 4, "bandwidth_factor": 0.7}
    assert "get 70% of their links' rate (measured: all-to-alls among 4 nodes at once)" in summarize(
        ClusterFile.from_json(doc))


def test_the_file_reads_without_changing_and_rejects_non_cluster_documents():
    doc = synthetic_doc()
    before = repr(doc)
    shown = ClusterFile.from_json(doc)
    summarize(shown)
    assert repr(doc) == before and shown.to_json() == doc      # written back as it was read
    with pytest.raises(PipetteError, match="not a megatron-pipette cluster file"):
        ClusterFile.from_json({"schema": "other"})


def test_heatmap_png(tmp_path):
    out = tmp_path / "bw.png"
    write_heatmap(ClusterFile.from_json(synthetic_doc()).cluster, out)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000
    assert [p.name for p in tmp_path.iterdir()] == ["bw.png"]      # no temporary left behind
    with pytest.raises(PipetteError, match="cannot write"):
        write_heatmap(ClusterFile.from_json(synthetic_doc()).cluster, tmp_path / "missing" / "bw.png")
