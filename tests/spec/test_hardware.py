import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.cluster_file import DENSE_LIST_LIMIT, cluster_from_json, cluster_to_json
from megatron_pipette.spec.hardware import Cluster, LinkLevel, lookup_gpu, make_cluster, preset_cluster

GOLDEN = Path(__file__).parents[1] / "golden"


def test_catalog_has_required_gpus_with_reference_figures():
    for name, mem_gb, peak in [("V100-32GB", 32, 125e12), ("A100-40GB", 40, 312e12), ("A100-80GB", 80, 312e12),
                               ("H100-80GB", 80, 989e12), ("H200", 141, 989e12), ("B200", 179, 2250e12),
                               ("GB200", 186, 2500e12), ("B300", 268.5, 2250e12), ("GB300", 279, 2500e12)]:
        gpu = lookup_gpu(name)      # the published GB read in GiB, as nvidia-smi shows Hopper's (hardware-sources.md)
        assert abs(gpu.memory_bytes / 2**30 - mem_gb) < 2
        assert gpu.peak("fp16") == peak
    assert lookup_gpu("NVIDIA H100 80GB HBM3").name == "H100-80GB"


def test_unknown_gpu_is_a_clear_error():
    with pytest.raises(PipetteError, match="--gpu 'R100'"):
        lookup_gpu("R100")
    with pytest.raises(PipetteError, match="--gpu V100-32GB has no bf16"):
        lookup_gpu("V100-32GB").peak("bf16")


def test_preset_links_are_intra_fast_inter_slow():
    c = preset_cluster("dgx-h100", num_nodes=2)
    assert c.world_size == 16
    lat, bw = c.link(np.array([0, 0]), np.array([7, 8]))
    assert bw.tolist() == [370e9, 47.5e9]
    assert lat[1] > lat[0]
    with pytest.raises(PipetteError, match="--cluster 'dgx-r100'"):
        preset_cluster("dgx-r100")
    with pytest.raises(PipetteError, match="--num-nodes"):
        preset_cluster("dgx-a100", num_nodes=0)


def test_a_preset_of_any_size_holds_no_node_by_node_array():
    c = preset_cluster("dgx-h100", num_nodes=16384)
    assert c.world_size == 131072
    held = [c.inter_node.bandwidth_Bps, c.inter_node.latency_s, *c.intra_node[0].figures(False)]
    assert all(m.strides == (0, 0) for m in held)          # broadcast views of one value
    assert c.gemm_flops.nbytes == 8 * 131072


def two_node_cluster(**rest) -> Cluster:
    """2 nodes of 4; node 1 in its own intra-node class with a slow 2<->3 link; rail links 10 GB/s."""
    fast = LinkLevel(bandwidth_Bps=np.full((4, 4), 100e9), latency_s=np.full((4, 4), 1e-6))
    slow = LinkLevel(bandwidth_Bps=fast.bandwidth_Bps.copy(), latency_s=fast.latency_s)
    slow.bandwidth_Bps[2, 3] = 1e9
    inter = LinkLevel(bandwidth_Bps=np.array([[np.inf, 10e9], [20e9, np.inf]]), latency_s=np.full((2, 2), 5e-6))
    return make_cluster(name="t", num_nodes=2, gpus_per_node=4, gpu=None, memory_bytes=2**34,
                        memory_bandwidth_Bps=1e12, gemm_flops=1e14, intra_node=(fast, slow),
                        node_class=np.array([0, 1]), inter_node=inter, **rest)


def test_link_reads_the_right_level_class_direction_and_rail():
    c = two_node_cluster(cross_rail_bandwidth_factor=0.5, cross_rail_latency_s=2e-6)
    src, dst = np.array([2, 6, 1, 5, 1, 2]), np.array([3, 7, 5, 1, 6, 7])
    lat, bw = c.link(src, dst)
    assert bw.tolist() == [100e9, 1e9, 10e9, 20e9, 5e9, 5e9]
    np.testing.assert_allclose(lat, [1e-6, 1e-6, 5e-6, 5e-6, 7e-6, 7e-6])
    assert c.full_duplex
    assert np.array_equal(c.link(src, dst, two_way=True)[1], bw)


def test_cluster_json_round_trip():
    c = preset_cluster("dgx-a100", num_nodes=2)
    back = cluster_from_json(json.loads(json.dumps(cluster_to_json(c))))
    assert back.world_size == 16 and back.gpu.name == "A100-80GB"
    devices = np.arange(16)
    assert all(np.array_equal(a, b) for a, b in zip(back.link(devices, devices[::-1]), c.link(devices, devices[::-1])))
    assert back.hosts == ("node0", "node1") and back.full_duplex


def test_cluster_json_keeps_classes_two_way_figures_and_cross_rail():
    c = two_node_cluster(cross_rail_bandwidth_factor=0.5, cross_rail_latency_s=2e-6)
    c = dataclasses.replace(c, inter_node=dataclasses.replace(
        c.inter_node, exchange_bandwidth_Bps=c.inter_node.bandwidth_Bps / 2,
        exchange_latency_s=c.inter_node.latency_s * 3))
    back = cluster_from_json(json.loads(json.dumps(cluster_to_json(c))))
    src, dst = np.array([2, 1, 1]), np.array([3, 5, 6])
    for two_way in (False, True):
        for a, b in zip(back.link(src, dst, two_way=two_way), c.link(src, dst, two_way=two_way)):
            np.testing.assert_array_equal(a, b)
    assert not back.full_duplex and back.node_class.tolist() == [0, 1]
    measured = cluster_from_json(json.loads(json.dumps(cluster_to_json(
        dataclasses.replace(c, all_to_all_bandwidth_factor=0.7)))))
    assert back.all_to_all_bandwidth_factor == 1.0 and measured.all_to_all_bandwidth_factor == 0.7


def test_large_node_matrices_travel_base64_encoded():
    n = DENSE_LIST_LIMIT + 4
    rng = np.random.default_rng(0)
    level = LinkLevel(bandwidth_Bps=rng.uniform(1e9, 5e10, (n, n)), latency_s=rng.uniform(1e-6, 1e-5, (n, n)))
    c = dataclasses.replace(preset_cluster("dgx-a100", num_nodes=n), inter_node=level)
    doc = cluster_to_json(c)
    assert set(doc["inter_node"]["bandwidth_Bps"]) == {"float32_base64", "shape"}
    back = cluster_from_json(json.loads(json.dumps(doc)))
    off = ~np.eye(n, dtype=bool)
    np.testing.assert_allclose(back.inter_node.bandwidth_Bps[off], level.bandwidth_Bps[off], rtol=1e-7)


def test_version_1_files_load_converted():
    v1 = json.loads((GOLDEN / "slow_node_cluster.json").read_text())
    assert v1["version"] == 1
    c = cluster_from_json(v1)
    assert (c.num_nodes, c.gpus_per_node, len(c.intra_node)) == (4, 8, 1)
    off = ~np.eye(4, dtype=bool)
    slow = (np.arange(4)[:, None] == 1) ^ (np.arange(4)[None, :] == 1)
    assert np.all(c.inter_node.bandwidth_Bps[off & slow] == 23.75e9 / 10)
    assert np.all(c.inter_node.bandwidth_Bps[off & ~slow] == 23.75e9)
    assert c.cross_rail_bandwidth_factor == 1.0


def test_version_1_conversion_keeps_the_slowest_rail_and_a_cross_rail_factor():
    v1 = json.loads((GOLDEN / "slow_node_cluster.json").read_text())
    bw = v1["bandwidth_Bps"]
    for i in range(32):
        for j in range(32):
            if i // 8 != j // 8 and i % 8 != j % 8:
                bw[i][j] *= 0.5                      # cross-rail pairs at half the rail rate
    bw[3][27] = 1e8                                   # node 0 -> node 3 on rail 3 is slow
    c = cluster_from_json(v1)
    assert c.cross_rail_bandwidth_factor == 0.5
    assert c.inter_node.bandwidth_Bps[0, 3] == 1e8 and c.inter_node.bandwidth_Bps[3, 0] == 23.75e9


def test_bad_cluster_files_are_clear_errors_version_1():
    doc = json.loads((GOLDEN / "slow_node_cluster.json").read_text())
    doc["devices"][9]["host"] = "node0"
    with pytest.raises(PipetteError, match="should share one host"):
        cluster_from_json(doc, where="--cluster f.json")


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=3), "version 3 is not supported"),
    (lambda d: d.pop("schema"), "not a megatron-pipette cluster file"),
    (lambda d: d.update(num_nodes=3), "'nodes' must list 3 nodes"),
    (lambda d: d.update(gpus_per_node=0), "'gpus_per_node' must be a positive integer"),
    (lambda d: d["devices"]["gemm_flops"].pop(),
     "devices.gemm_flops must list a finite number of at least 1e\\+06 for each of the 16"),
    (lambda d: d["devices"]["memory_bytes"].__setitem__(3, 0), "devices.memory_bytes"),
    (lambda d: d["intra_node"][0]["bandwidth_Bps"][0].__setitem__(1, None), "bandwidth_Bps"),
    (lambda d: d["inter_node"]["latency_s"].pop(), "inter_node: 'latency_s' must be a 2x2 matrix"),
    (lambda d: d["inter_node"]["bandwidth_Bps"][1].__setitem__(0, -5.0), "negative"),
    (lambda d: d["inter_node"].update(bandwidth_Bps={"float32_base64": "@@", "shape": [2, 2]}), "not a valid"),
    (lambda d: d["nodes"][1].update({"class": 4}), "'class' must index 'intra_node'"),
    (lambda d: d["inter_node"].update(cross_rail_bandwidth_factor=1.5), "cross_rail_bandwidth_factor"),
    (lambda d: d["inter_node"].update(all_to_all_bandwidth_factor=0), "all_to_all_bandwidth_factor must be in"),
    (lambda d: d.pop("intra_node"), "'intra_node' must be a non-empty list"),
])
def test_bad_cluster_files_are_clear_errors(mutate, message):
    doc = copy.deepcopy(cluster_to_json(preset_cluster("dgx-a100", num_nodes=2)))
    mutate(doc)
    with pytest.raises(PipetteError, match=message):
        cluster_from_json(doc, where="--cluster f.json")


def test_blackwell_entries_and_the_nvl72_domain():
    assert lookup_gpu("B200").peak("fp8") == 4500e12 and lookup_gpu("GB200").peak("bf16") == 2500e12
    c = preset_cluster("gb200-nvl72", num_nodes=36)
    assert (c.gpus_per_node, c.gpus_per_domain) == (4, 72)
    lat, bw = c.link(np.array([0, 0]), np.array([71 * 1, 72]))     # same domain, next domain
    assert bw.tolist() == [740e9, 47.5e9]
    with pytest.raises(PipetteError, match="--num-nodes must be at most 16384, got 16386"):
        preset_cluster("gb200-nvl72", num_nodes=16386)


def test_an_nvl72_job_over_several_racks_takes_an_equal_share_of_each():
    """Issue 31: 256 GPUs (64 trays) take 16 trays in each of 4 racks, as NVIDIA's runs did (HybridEP
    told 64 expert-parallel ranks a domain), not 18, 18, 18 and 10; one rack or two whole ones as before."""
    c = preset_cluster("gb200-nvl72", num_nodes=64)
    assert np.bincount(c.domains).tolist() == [16] * 4 and c.gpus_per_domain == 64
    lat, bw = c.link(np.array([63, 64]), np.array([0, 0]))             # rack 0's last tray; rack 1's first
    assert bw.tolist() == [740e9, 47.5e9]
    assert np.bincount(preset_cluster("gb300-nvl72", num_nodes=50).domains).tolist() == [17, 17, 16]
    assert np.bincount(preset_cluster("gb200-nvl72", num_nodes=36).domains).tolist() == [18, 18]
    assert preset_cluster("gb200-nvl72", num_nodes=16).gpus_per_domain == 64


def test_gb300_nvl72_is_gb200s_rack_with_the_b300_and_connectx8():
    """GB300 NVL72 (issue 31): the 1400 W B300 (docs/hardware-sources.md), 4 GPUs a tray, 18 trays a
    72-GPU NVLink domain, 800 Gb/s per GPU beyond it (95 GB/s at NDR's 95%)."""
    gpu = lookup_gpu("GB300")
    usable = (279 * 1024 - 474) * 2**20         # 279 GiB less nvidia-smi's excess over torch's total
    assert (gpu.memory_bytes, gpu.peak("bf16"), gpu.peak("fp8"), gpu.peak("fp4")) == (usable, 2500e12, 5e15, 15e15)
    c = preset_cluster("gb300-nvl72", num_nodes=36)
    assert (c.gpu.name, c.gpus_per_node, c.gpus_per_domain, c.nvls) == ("GB300", 4, 72, True)
    lat, bw = c.link(np.array([0, 0]), np.array([71, 72]))
    assert bw.tolist() == [740e9, 95e9]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["inter_node"]["bandwidth_Bps"][1].__setitem__(0, 0.0), "'bandwidth_Bps' has an off-diagonal entry"),
    (lambda d: d["inter_node"]["bandwidth_Bps"][1].__setitem__(0, 1e-300), "below 1000 B/s"),
    (lambda d: d["intra_node"][0]["bandwidth_Bps"][0].__setitem__(1, float("inf")), "non-finite"),
    (lambda d: d["intra_node"][0]["latency_s"][0].__setitem__(1, float("nan")), "'latency_s' has an off-diagonal"),
    (lambda d: d["inter_node"]["latency_s"][0].__setitem__(1, 1e300), "above 10 s"),
    (lambda d: d["inter_node"]["latency_s"][0].__setitem__(1, 10 ** 400), "non-numeric"),
    (lambda d: d["inter_node"].update(cross_rail_latency_s=float("nan")), "cross_rail_latency_s in"),
    (lambda d: d["devices"]["gemm_flops"].__setitem__(0, 1e-300), "devices.gemm_flops must list a finite number"),
    (lambda d: d["devices"]["memory_bytes"].__setitem__(0, float("inf")), "devices.memory_bytes"),
    (lambda d: d["devices"]["memory_bandwidth_Bps"].__setitem__(0, 10 ** 400), "devices.memory_bandwidth_Bps"),
    (lambda d: d.update(num_nodes=10 ** 9), "'num_nodes' must be at most 16384"),
    (lambda d: d.update(gpus_per_node=True), "'gpus_per_node' must be a positive integer"),
])
def test_link_and_device_figures_are_finite_and_physical(mutate, message):
    """A bandwidth of 0 or 1e-300 (the schema allowed >= 0) made every time infinite and ranked NaN
    plans first; an infinite memory was an OverflowError."""
    doc = copy.deepcopy(cluster_to_json(preset_cluster("dgx-a100", num_nodes=2)))
    mutate(doc)
    with pytest.raises(PipetteError, match=message):
        cluster_from_json(doc, where="--cluster f.json")


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["devices"][3].update(rank="3"), "device ranks must be 0..31"),
    (lambda d: d["devices"].__setitem__(0, 7), "'devices' must be a non-empty list of objects"),
    (lambda d: d["devices"][0].update(host=["node0"]), "should share one host"),
    (lambda d: d["devices"][5].update(gemm_flops=float("inf")), "device 5 needs a finite 'gemm_flops'"),
    (lambda d: d["bandwidth_Bps"][0].__setitem__(1, 1e-300), "below 1000 B/s"),
])
def test_version_1_files_are_checked_alike(mutate, message):
    doc = json.loads((GOLDEN / "slow_node_cluster.json").read_text())
    mutate(doc)
    with pytest.raises(PipetteError, match=message):
        cluster_from_json(doc, where="--cluster f.json")


@pytest.mark.parametrize("overrides, message", [
    (dict(num_nodes=10 ** 9), "--num-nodes must be at most 16384, got 1000000000"),
    (dict(gpus_per_node=1025), "--gpus-per-node must be at most 1024"),
    (dict(num_nodes=0), "--num-nodes must be a positive integer"),
])
def test_preset_clusters_are_bounded_before_arrays_are_built(overrides, message):
    with pytest.raises(PipetteError, match=message):
        preset_cluster("dgx-h100", **overrides)
