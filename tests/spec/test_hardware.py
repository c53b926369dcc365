import copy
import dataclasses

import numpy as np
import pytest

from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.cluster_file import cluster_from_json, cluster_to_json
from megatron_pipette.spec.hardware import lookup_gpu, preset_cluster


def test_catalog_has_required_gpus_with_reference_figures():
    for name, mem_gb, peak in [("V100-32GB", 32, 125e12), ("A100-40GB", 40, 312e12), ("A100-80GB", 80, 312e12),
                               ("H100-80GB", 80, 989e12), ("H200", 141, 989e12)]:
        gpu = lookup_gpu(name)
        assert abs(gpu.memory_bytes / 2**30 - mem_gb) < 2
        assert gpu.peak("fp16") == peak
    assert lookup_gpu("NVIDIA H100 80GB HBM3").name == "H100-80GB"


def test_unknown_gpu_is_a_clear_error():
    with pytest.raises(PipetteError, match="--gpu 'B300'"):
        lookup_gpu("B300")
    with pytest.raises(PipetteError, match="--gpu V100-32GB has no bf16"):
        lookup_gpu("V100-32GB").peak("bf16")


def test_preset_links_are_intra_fast_inter_slow():
    c = preset_cluster("dgx-h100", num_nodes=2)
    assert c.world_size == 16
    assert c.bandwidth_Bps[0, 7] == 370e9 and c.bandwidth_Bps[0, 8] == 47.5e9
    assert c.latency_s[0, 8] > c.latency_s[0, 1]
    with pytest.raises(PipetteError, match="--cluster 'dgx-b200'"):
        preset_cluster("dgx-b200")
    with pytest.raises(PipetteError, match="--num-nodes"):
        preset_cluster("dgx-a100", num_nodes=0)


def test_cluster_json_round_trip():
    c = preset_cluster("dgx-a100", num_nodes=2)
    back = cluster_from_json(cluster_to_json(c))
    assert back.world_size == 16 and back.gpu.name == "A100-80GB"
    assert np.array_equal(back.bandwidth_Bps[~np.eye(16, dtype=bool)], c.bandwidth_Bps[~np.eye(16, dtype=bool)])
    assert back.hosts == ("node0", "node1")
    assert back.full_duplex and back.two_way_bandwidth_Bps is back.bandwidth_Bps
    assert back.two_way_latency_s is back.latency_s


def test_cluster_json_keeps_the_two_way_bandwidth():
    c = preset_cluster("dgx-a100", num_nodes=2)
    c = dataclasses.replace(c, exchange_bandwidth_Bps=c.bandwidth_Bps / 2, exchange_latency_s=c.latency_s * 3)
    back = cluster_from_json(cluster_to_json(c))
    off = ~np.eye(16, dtype=bool)
    assert np.array_equal(back.two_way_bandwidth_Bps[off], c.bandwidth_Bps[off] / 2)
    assert np.array_equal(back.two_way_latency_s[off], c.latency_s[off] * 3) and not back.full_duplex
    doc = cluster_to_json(c)
    doc["exchange_bandwidth_Bps"][2][3] = -1.0
    with pytest.raises(PipetteError, match="exchange_bandwidth_Bps"):
        cluster_from_json(doc)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=2), "version 2"),
    (lambda d: d.pop("schema"), "not a megatron-pipette cluster file"),
    (lambda d: d.update(gpus_per_node=3), "gpus_per_node 3"),
    (lambda d: d["devices"][9].update(host="node0"), "should share one host"),
    (lambda d: d["bandwidth_Bps"][0].__setitem__(1, None), "bandwidth_Bps"),
    (lambda d: d["latency_s"].pop(), "latency_s"),
    (lambda d: d["devices"][3].update(gemm_flops=0), "gemm_flops"),
    (lambda d: d["devices"].pop(), "gpus_per_node"),
])
def test_bad_cluster_files_are_clear_errors(mutate, message):
    doc = copy.deepcopy(cluster_to_json(preset_cluster("dgx-a100", num_nodes=2)))
    mutate(doc)
    with pytest.raises(PipetteError, match=message):
        cluster_from_json(doc, where="--cluster f.json")
