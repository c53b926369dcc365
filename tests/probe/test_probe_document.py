"""From measured times to the cluster document: the fits, and the whole probe on its twin.

The twin runs the probe's real engine and document code over simulated messages, so these
tests check the probe end to end without processes: a noise-free twin must return its truth.
"""

import dataclasses
import json
import math

import numpy as np
import pytest

from helpers.clusters import dense, slowed_nodes
from megatron_pipette.errors import PipetteError
from megatron_pipette.probe.budget import plan_budget
from megatron_pipette.probe.document import build_document, gpus_per_node
from megatron_pipette.probe.engine import run_engine
from megatron_pipette.probe.fit import alpha_beta, medium_bytes, pair_min, two_way_alpha_beta
from megatron_pipette.probe.schedule import NEW_NODE_ROUNDS
from megatron_pipette.probe.twin import TwinSettings, TwinTransport, run_twin
from megatron_pipette.spec.cluster_file import ClusterFile, NodeIdentity, cluster_from_json, select_nodes
from megatron_pipette.spec.hardware import LinkLevel, preset_cluster

NAN = math.nan
S, L = 4096, 64 * 2**20


def test_gpus_per_node_from_hosts():
    assert gpus_per_node(["a"] * 4) == 4
    assert gpus_per_node(["a", "a", "b", "b"]) == 2
    for bad in (["a", "b", "a", "b"], ["a", "a", "a", "b"], ["a", "b", "b"]):
        with pytest.raises(PipetteError, match="consecutive"):
            gpus_per_node(bad)


def test_pair_min_takes_the_smaller_side_and_is_symmetric():
    t = pair_min(np.array([[NAN, 2.0, NAN], [3.0, NAN, NAN], [NAN, NAN, NAN]]))
    assert t[0, 1] == t[1, 0] == 2.0
    assert np.isnan(t[0, 2]) and np.isnan(t[0, 0])


def test_alpha_beta_recovers_the_model():
    alpha, beta = 20e-6, 100e9
    ts = np.array([[2 * alpha + S / beta]])         # the message and its one-byte reply
    tl = np.array([[2 * alpha + L / beta]])
    bw, lat = alpha_beta(ts, tl, S, L)
    assert bw[0, 0] == pytest.approx(beta) and lat[0, 0] == pytest.approx(alpha)
    # a small timing inflated by noise: fall back to L / t(L), never an absurd bandwidth
    bw, lat = alpha_beta(np.array([[0.9e-3]]), np.array([[1e-3]]), S, L)
    assert bw[0, 0] == pytest.approx(L / 1e-3) and lat[0, 0] >= 0


def test_two_way_alpha_beta_from_two_exchange_sizes():
    m = medium_bytes(S, L)
    assert m == 512 * 2**10 and medium_bytes(4096, 4 * 2**20) == 128 * 2**10
    one_way, alpha = np.array([[np.inf, 1e8], [2e8, np.inf]]), np.array([[0.0, 1e-3], [1e-3, 0.0]])
    # half duplex, and a medium exchange that loses 20 ms more (acknowledgements behind data)
    tm = pair_min(np.array([[NAN, 0.021 + m / 0.5e8], [NAN, NAN]]))
    tl = pair_min(np.array([[NAN, 0.021 + L / 0.5e8], [NAN, NAN]]))
    bw, lat = two_way_alpha_beta(tm, tl, m, L, one_way, alpha)
    np.testing.assert_allclose(bw[[0, 1], [1, 0]], [0.5e8, 0.5e8])
    np.testing.assert_allclose(lat[[0, 1], [1, 0]], [0.021, 0.021])
    # full duplex: never above the one-way rate (the exchange ends with the slower direction),
    # and never below the one-way latency
    tm, tl = pair_min(np.array([[NAN, m / 1e8], [NAN, NAN]])), pair_min(np.array([[NAN, L / 1e8], [NAN, NAN]]))
    bw, lat = two_way_alpha_beta(tm, tl, m, L, one_way, alpha)
    np.testing.assert_allclose(bw[[0, 1], [1, 0]], [1e8, 1e8])
    np.testing.assert_allclose(lat[[0, 1], [1, 0]], [1e-3, 1e-3])


def identities(truth):
    return [{"host": f"node{r // truth.gpus_per_node}", "device_name": "NVIDIA H100 80GB HBM3", "gpu": "H100-80GB",
             "memory_bytes": truth.memory_bytes} for r in range(truth.world_size)]


def probe_twin(truth, budget_s=30.0, noise=0.0, seed=0, repeats=3, batched=False):
    transport = TwinTransport(truth, TwinSettings(small_bytes=S, large_bytes=L, noise=noise, seed=seed,
                                                  batched=batched))
    m = run_engine(transport, plan_budget(budget_s), repeats=repeats, large_bytes=L)
    doc = build_document(m, identities(truth), name="twin", precision="bf16", small_bytes=S, large_bytes=L,
                         max_repeats=repeats, probe_meta={"backend": "twin"})
    return cluster_from_json(json.loads(json.dumps(doc))), doc, transport.clock


def symmetric(m):
    return np.minimum(m, m.T)


def uneven_truth(nodes=6, gpn=4, seed=0):
    """Two intra-node classes, random node pairs (symmetric exchange figures, as an exchange is
    timed as a whole), half-duplex inter-node exchanges, a cross-rail penalty."""
    rng = np.random.default_rng(seed)
    base = preset_cluster("dgx-h100", num_nodes=nodes, gpus_per_node=gpn)
    intra = dense(base.intra_node[0])
    slow_intra = dense(intra)
    slow_intra.bandwidth_Bps[1, 2] /= 5      # both directions: an exchange is timed as a whole
    slow_intra.bandwidth_Bps[2, 1] /= 5
    bw = 47.5e9 * rng.uniform(0.3, 1, (nodes, nodes))
    lat = 1e-5 * rng.uniform(1, 3, (nodes, nodes))
    inter = LinkLevel(bandwidth_Bps=bw, latency_s=symmetric(lat), exchange_bandwidth_Bps=symmetric(bw) / 2,
                      exchange_latency_s=symmetric(lat) * 2)
    return dataclasses.replace(base, intra_node=(intra, slow_intra), node_class=np.arange(nodes) % 2,
                               inter_node=inter, cross_rail_bandwidth_factor=0.6, cross_rail_latency_s=3e-6)


def test_a_noise_free_twin_returns_its_truth():
    truth = uneven_truth()
    probed, doc, clock = probe_twin(truth)
    p = doc["probe"]
    assert p["inter_rounds_measured"] == p["inter_rounds"] and p["skipped"] == [] and clock < 30
    assert len(probed.intra_node) == 2 and probed.node_class.tolist() == [0, 1, 0, 1, 0, 1]
    rng = np.random.default_rng(1)
    src, dst = rng.integers(0, truth.world_size, (2, 500))
    src, dst = src[src != dst], dst[src != dst]
    for two_way in (False, True):
        (lat, bw), (true_lat, true_bw) = probed.link(src, dst, two_way=two_way), truth.link(src, dst, two_way=two_way)
        np.testing.assert_allclose(bw, true_bw, rtol=1e-6)
        np.testing.assert_allclose(lat, true_lat, rtol=1e-3)   # the fit neglects the one-byte reply's transfer
    assert probed.cross_rail_bandwidth_factor == pytest.approx(0.6)
    assert probed.cross_rail_latency_s == pytest.approx(3e-6, rel=1e-3)
    np.testing.assert_allclose(probed.gemm_flops, truth.gemm_flops)
    assert p["slow_links"] == [] or all(link["bandwidth_Bps"] < 0.5 * link["predicted_Bps"] for link in p["slow_links"])


def test_batched_exchanges_timed_apart_come_back_and_only_1f1b_hops_pay_them():
    """gloo: an exchange posted as 1F1B posts it (both sides' send first) runs slower on some links
    than one posted in opposite orders; the probe returns both figures, the cost model prices
    pipeline hops with the batched one and ring steps with the link's own."""
    truth = uneven_truth()
    inter, intra = truth.inter_node, truth.intra_node[1]
    slow = symmetric(inter.exchange_bandwidth_Bps) / 3
    truth = dataclasses.replace(
        truth, inter_node=dataclasses.replace(inter, batched_exchange_bandwidth_Bps=slow,
                                              batched_exchange_latency_s=inter.exchange_latency_s * 2),
        intra_node=(truth.intra_node[0], dataclasses.replace(intra, batched_exchange_bandwidth_Bps=symmetric(
            intra.exchange_bandwidth_Bps if intra.exchange_bandwidth_Bps is not None else intra.bandwidth_Bps) / 2)))
    rng = np.random.default_rng(2)
    src, dst = rng.integers(0, truth.world_size, (2, 500))
    src, dst = src[src != dst], dst[src != dst]
    probed, doc, _ = probe_twin(truth, batched=True)
    assert "batched_exchange_bandwidth_Bps" in doc["inter_node"]
    for two_way, batched in ((True, False), (True, True)):
        (lat, bw) = probed.link(src, dst, two_way=two_way, batched=batched)
        (true_lat, true_bw) = truth.link(src, dst, two_way=two_way, batched=batched)
        np.testing.assert_allclose(bw, true_bw, rtol=1e-6)
        np.testing.assert_allclose(lat, true_lat, rtol=1e-3)
    # NCCL's transport does not time them apart: the batched figure is the exchange figure
    probed, doc, _ = probe_twin(truth)
    assert "batched_exchange_bandwidth_Bps" not in doc["inter_node"]
    np.testing.assert_array_equal(probed.link(src, dst, two_way=True, batched=True)[1],
                                  probed.link(src, dst, two_way=True)[1])


def test_the_budget_leaves_pairs_to_the_per_node_fit_which_still_finds_a_slow_node():
    nodes = 64
    truth = preset_cluster("dgx-h100", num_nodes=nodes, gpus_per_node=2)
    truth = dataclasses.replace(truth, inter_node=slowed_nodes(truth.inter_node, [7], 4.0))
    probed, doc, clock = probe_twin(truth, budget_s=0.9, noise=0.02)
    p = doc["probe"]
    assert 3 <= p["inter_rounds_measured"] < p["inter_rounds"], p["inter_rounds_measured"]
    assert clock <= 0.9
    assert [n["node"] for n in p["slow_nodes"]] == [7]
    assert p["slow_nodes"][0]["rate_Bps"] == pytest.approx(47.5e9 / 4, rel=0.25)
    bw = probed.inter_node.bandwidth_Bps
    others = [k for k in range(nodes) if k != 7]
    np.testing.assert_allclose(bw[7, others], 47.5e9 / 4, rtol=0.25)      # measured or filled alike
    off = ~np.eye(nodes, dtype=bool)
    off[7, :] = off[:, 7] = False
    np.testing.assert_allclose(bw[off], 47.5e9, rtol=0.25)
    assert any(s["what"] == "rounds" and s["phase"] == "inter-node" for s in p["skipped"])
    assert all("pairs" not in s for s in p["skipped"])                      # listed compactly


def test_the_file_names_each_nodes_gpus_and_the_pairs_measured_and_a_subset_keeps_both():
    """What a later allocation reuses: which machine each node was, which node pairs were measured
    rather than filled, and (select) the figures of some of the nodes, unchanged; older files load
    without them."""
    nodes = 64
    truth = preset_cluster("dgx-h100", num_nodes=nodes, gpus_per_node=2)
    transport = TwinTransport(truth, TwinSettings(small_bytes=S, large_bytes=L, noise=0.02))
    m = run_engine(transport, plan_budget(0.5), repeats=3, large_bytes=L)
    ids = [{**ident, "gpu_id": f"GPU-{r}"} for r, ident in enumerate(identities(truth))]
    doc = json.loads(json.dumps(build_document(m, ids, name="twin", precision="bf16", small_bytes=S, large_bytes=L,
                                               max_repeats=3, probe_meta={"backend": "twin"})))
    probed = ClusterFile.from_json(doc)
    assert probed.node_identities[5] == NodeIdentity("node5", ("GPU-10", "GPU-11"))
    measured = probed.measured_pairs
    assert 0 < measured.sum() == 2 * doc["probe"]["node_pairs_measured"] < nodes * (nodes - 1)
    assert (measured == measured.T).all() and not measured.diagonal().any()
    kept = [5, 2, 9, 40]
    survivors = ClusterFile.from_json(json.loads(json.dumps(probed.select(kept, "survivors").to_json())))
    ix = np.ix_(kept, kept)
    assert survivors.node_identities == tuple(probed.node_identities[k] for k in kept)
    assert (survivors.measured_pairs == measured[ix]).all()
    for key in ("bandwidth_Bps", "latency_s", "exchange_bandwidth_Bps"):
        got, want = getattr(survivors.cluster.inter_node, key), getattr(probed.cluster.inter_node, key)[ix]
        np.testing.assert_array_equal(got[~np.eye(4, dtype=bool)], want[~np.eye(4, dtype=bool)])
    ranks = np.array([[2 * k, 2 * k + 1] for k in kept]).ravel()
    np.testing.assert_array_equal(survivors.cluster.gemm_flops, probed.cluster.gemm_flops[ranks])
    assert survivors.probe.backend == "reused" and survivors.probe.duration_s == 0
    same, other = NodeIdentity("node9", ("GPU-18", "GPU-19")), NodeIdentity("node9", ("x", "y"))
    assert probed.nodes_of([same, other]) == [9, None]
    for node in doc["nodes"]:
        del node["gpus"]
    del doc["inter_node"]["measured"]
    older = ClusterFile.from_json(doc)
    assert older.node_identities is None and older.measured_pairs is None and older.nodes_of([]) == []


def test_an_allocation_with_nodes_measured_before_probes_only_rounds_with_a_new_node_and_keeps_the_rest():
    """20 of 24 nodes were probed before; the new probe runs at most NEW_NODE_ROUNDS inter-node rounds,
    each with a new node in it, and with_known takes the first probe's figures for the pairs of old
    nodes it left out; a slow new node is priced from its few partners."""
    nodes, slow = 24, 22
    truth = preset_cluster("dgx-h100", num_nodes=nodes, gpus_per_node=2)
    truth = dataclasses.replace(truth, inter_node=slowed_nodes(truth.inter_node, [slow], 4.0))

    def probe(cluster, known=None):
        return ClusterFile.from_json(json.loads(json.dumps(run_twin(
            cluster, budget_s=30, small_bytes=S, large_bytes=L, repeats=1, noise=0.02, known_nodes=known).doc)))

    before = probe(select_nodes(truth, range(20), "first"))
    everyone = probe(truth)
    where = before.nodes_of(everyone.node_identities)
    assert where == [*range(20), None, None, None, None]
    now = probe(truth, known=np.array([w is not None for w in where]))
    p = now.probe
    assert p.inter_rounds_measured == p.inter_rounds <= NEW_NODE_ROUNDS + 2 < everyone.probe.inter_rounds
    assert p.duration_s < everyone.probe.duration_s
    merged = now.with_known(before, where)
    old = np.ix_(range(20), range(20))
    skipped = ~now.measured_pairs[old] & ~np.eye(20, dtype=bool)
    assert skipped.any()
    for key in ("bandwidth_Bps", "latency_s"):
        np.testing.assert_array_equal(getattr(merged.cluster.inter_node, key)[old][skipped],
                                      getattr(before.cluster.inter_node, key)[skipped])
    assert (merged.measured_pairs[old] == (now.measured_pairs[old] | before.measured_pairs)).all()
    assert merged.probe.backend == "twin"
    others = [k for k in range(nodes) if k != slow]
    np.testing.assert_allclose(merged.cluster.inter_node.bandwidth_Bps[slow, others], 47.5e9 / 4, rtol=0.25)
    again = ClusterFile.from_json(json.loads(json.dumps(merged.to_json())))
    np.testing.assert_array_equal(again.cluster.inter_node.bandwidth_Bps, merged.cluster.inter_node.bandwidth_Bps)


def test_a_slow_pair_is_reported_when_its_round_ran():
    nodes = 8
    truth = preset_cluster("dgx-h100", num_nodes=nodes, gpus_per_node=2)
    inter = dense(truth.inter_node)
    inter.bandwidth_Bps[2, 5] = inter.bandwidth_Bps[5, 2] = 4.75e9
    probed, doc, _ = probe_twin(dataclasses.replace(truth, inter_node=inter), noise=0.02)
    slow = {tuple(link["nodes"]) for link in doc["probe"]["slow_links"]}
    assert slow == {(2, 5), (5, 2)}
    assert probed.inter_node.bandwidth_Bps[2, 5] == pytest.approx(4.75e9, rel=0.25)
    assert doc["probe"]["slow_nodes"] == []


def test_the_twin_is_deterministic_for_a_seed():
    truth = uneven_truth(4, 3)
    assert probe_twin(truth, noise=0.1, seed=3)[1] == probe_twin(truth, noise=0.1, seed=3)[1]
    assert probe_twin(truth, noise=0.1, seed=3)[1] != probe_twin(truth, noise=0.1, seed=4)[1]


@pytest.mark.parametrize("nodes, factor", [(4, 0.6), (9, 1.0), (2, 0.45)])
def test_the_twin_finds_its_truths_all_to_all_factor(nodes, factor):
    """Blocks of four nodes (a last one of one node sits out, nine nodes) time their all-to-all; the
    probed file's factor is the truth's, which prices the all-to-all between nodes and nothing else."""
    truth = dataclasses.replace(preset_cluster("dgx-h100", num_nodes=nodes), all_to_all_bandwidth_factor=factor)
    probed, doc, _ = probe_twin(truth)
    report = doc["probe"]["all_to_all"]
    assert report["repeats"] == 3 and report["bytes_per_peer"] == L // (3 * 8)
    assert probed.all_to_all_bandwidth_factor == pytest.approx(factor, rel=1e-6)
    assert report["block_share"][-1] is None if nodes % 4 == 1 else report["block_share"][-1] == pytest.approx(factor)


def test_one_node_has_no_all_to_all_and_a_spent_budget_says_it_skipped_it():
    one, doc, _ = probe_twin(preset_cluster("dgx-h100", num_nodes=1))
    assert one.all_to_all_bandwidth_factor == 1.0 and doc["probe"]["all_to_all"] is None
    truth = dataclasses.replace(preset_cluster("dgx-h100", num_nodes=64), all_to_all_bandwidth_factor=0.5)
    probed, doc, clock = probe_twin(truth, budget_s=0.05)
    assert probed.all_to_all_bandwidth_factor == 1.0 and doc["probe"]["all_to_all"]["repeats"] == 0
    assert "all_to_all" in [s["what"] for s in doc["probe"]["skipped"]]


def test_blocks_inside_one_nvlink_domain_measure_no_all_to_all_factor():
    """GB200 NVL72: four hosts of one domain talk over NVLink, which the factor does not describe."""
    truth = preset_cluster("gb200-nvl72", num_nodes=36)
    probed, doc, _ = probe_twin(dataclasses.replace(truth, all_to_all_bandwidth_factor=0.5))
    assert doc["probe"]["all_to_all"]["bandwidth_factor"] is None and probed.all_to_all_bandwidth_factor == 1.0
