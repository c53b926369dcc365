"""Alpha-beta collectives and p2p on each group's actual links."""

import dataclasses

import numpy as np
import pytest

from helpers.clusters import dense
from megatron_pipette.cost.comm import group_links, rings
from megatron_pipette.spec.hardware import Cluster, LinkLevel, make_cluster, preset_cluster


def cluster(nodes=2, gpn=4, intra=100e9, inter=10e9, lat=1e-5, cross_rail=1.0) -> Cluster:
    return make_cluster(name="t", num_nodes=nodes, gpus_per_node=gpn, gpu=None, memory_bytes=80 * 2**30,
                        memory_bandwidth_Bps=2e12, gemm_flops=200e12,
                        intra_node=LinkLevel(bandwidth_Bps=np.full((gpn, gpn), intra),
                                             latency_s=np.full((gpn, gpn), lat)),
                        inter_node=LinkLevel(bandwidth_Bps=np.full((nodes, nodes), inter),
                                             latency_s=np.full((nodes, nodes), lat)),
                        cross_rail_bandwidth_factor=cross_rail)


def half_duplex(level: LinkLevel) -> LinkLevel:
    return dataclasses.replace(level, exchange_bandwidth_Bps=level.bandwidth_Bps / 2,
                               exchange_latency_s=level.latency_s * 3)


def test_ring_all_reduce_known_answer():
    c = cluster(1, 4)
    r = rings(np.arange(4)[None], c)
    s = 1e9
    assert r.all_reduce_s(s)[0] == pytest.approx(1e-5 + 2 * 3 * s / 4 / 100e9)
    assert r.reduce_scatter_s(s)[0] == pytest.approx(1e-5 + 3 * s / 4 / 100e9)
    assert r.all_gather_s(s)[0] == r.reduce_scatter_s(s)[0]


@pytest.mark.parametrize("n", [2, 8])
def test_a_ring_collective_pays_one_start_up_whatever_its_size(n):
    """NCCL runs a ring collective as one kernel that pipelines its chunks around the ring: one
    start-up latency, not one per ring step (2(n-1) for an all-reduce)."""
    r = rings(np.arange(n)[None], cluster(1, 8, lat=7e-6))
    assert r.all_reduce_s(0.0)[0] == r.reduce_scatter_s(0.0)[0] == r.all_gather_s(0.0)[0] == pytest.approx(7e-6)


def test_half_duplex_links_slow_rings_and_exchanges_but_not_single_messages():
    full = cluster(2, 4)
    half = dataclasses.replace(full, intra_node=(half_duplex(full.intra_node[0]),),
                               inter_node=half_duplex(full.inter_node))
    a, b = group_links(1, 2, 4, full), group_links(1, 2, 4, half)
    assert a.exchange_s(1e8) is None
    np.testing.assert_array_equal(a.p2p_s(1e8), b.p2p_s(1e8))
    for exchange, alone in zip(b.exchange_s(1e8), a.p2p_s(1e8), strict=True):    # activation, gradient
        np.testing.assert_allclose(exchange - 3e-5, 2 * (alone - 1e-5))
    ring_a, ring_b = a.dp_cp_groups.all_reduce_s(1e9), b.dp_cp_groups.all_reduce_s(1e9)
    np.testing.assert_allclose(ring_b - 3e-5, 2 * (ring_a - 1e-5))


def test_batched_exchange_figures_price_pipeline_exchanges_and_nothing_else():
    """1F1B posts its exchanges as one batch with the send first on both sides (gloo can then hold
    the receive behind the send): its hops take the batched figures; rings keep the link's own."""
    half = cluster(2, 4)
    half = dataclasses.replace(half, intra_node=(half_duplex(half.intra_node[0]),),
                               inter_node=half_duplex(half.inter_node))

    def batched(level: LinkLevel) -> LinkLevel:
        return dataclasses.replace(level, batched_exchange_bandwidth_Bps=level.bandwidth_Bps / 4,
                                   batched_exchange_latency_s=level.latency_s * 5)
    slow = dataclasses.replace(half, intra_node=(batched(half.intra_node[0]),), inter_node=batched(half.inter_node))
    a, b = group_links(1, 2, 4, half), group_links(1, 2, 4, slow)
    np.testing.assert_array_equal(a.p2p_s(1e8), b.p2p_s(1e8))
    for exchange, alone in zip(b.exchange_s(1e8), a.p2p_s(1e8), strict=True):
        np.testing.assert_allclose(exchange - 5e-5, 4 * (alone - 1e-5))
    np.testing.assert_array_equal(a.dp_cp_groups.all_reduce_s(1e9), b.dp_cp_groups.all_reduce_s(1e9))
    # without exchange figures of their own, the batched ones alone make the links not full duplex
    only = dataclasses.replace(cluster(2, 4), inter_node=batched(cluster(2, 4).inter_node))
    assert not only.full_duplex and group_links(1, 2, 4, only).exchange_s(1e8) is not None


def test_single_rank_groups_cost_nothing():
    links = group_links(1, 1, 8, cluster())
    assert links.tp_groups.all_reduce_s(1e9).max() == 0
    assert all(np.all(hop == 0) for hop in links.p2p_s(1e9))


def test_groups_follow_megatrons_rank_order():
    # logical rank = tp_rank + tp * (dp_rank + dp * pp_rank)
    links = group_links(2, 2, 2, cluster())
    assert links.devices[1, 0, 1] == 1 + 2 * (0 + 2 * 1)
    placement = np.arange(8)[::-1]
    assert group_links(2, 2, 2, cluster(), placement).devices[1, 0, 1] == placement[5]


def test_ring_uses_its_slowest_link_and_only_its_own():
    c = cluster(1, 8)
    c.intra_node[0].bandwidth_Bps[2, 3] = 1e9          # inside TP group (pp 0, dp 1): devices 2, 3
    links = group_links(2, 1, 4, c)
    cost = links.tp_groups.all_reduce_s(1e8)
    assert cost[0, 1] > cost[0, 0] * 5
    assert cost[0, 0] == cost[0, 2] == cost[0, 3]


def test_a_ring_leaves_a_node_on_as_many_rails_as_it_has_ranks_there():
    """NCCL runs one channel per rail: a ring with k ranks on a node crosses to the next on k rails
    (the per-rail figure is each rail's rate while every rail runs), shared among the ring's exits
    from the node; never faster than its links inside the node."""
    c = cluster(2, 4, intra=100e9, inter=10e9)
    inv = {name: rings(order[None], c).inv_bw_s_per_B[0] for name, order in {
        "contiguous": np.arange(8), "alternating": np.array([0, 4, 1, 5, 2, 6, 3, 7]),
        "pairs": np.array([0, 1, 4, 5, 2, 3, 6, 7]), "one per node": np.array([0, 4])}.items()}
    assert inv["contiguous"] == pytest.approx(1 / 40e9)            # 4 ranks, one exit: 4 rails
    assert inv["pairs"] == pytest.approx(1 / 20e9)                 # 4 ranks, two exits
    assert inv["alternating"] == inv["one per node"] == pytest.approx(1 / 10e9)
    assert rings(np.arange(8)[None], cluster(2, 4, intra=30e9, inter=10e9)).inv_bw_s_per_B[0] == pytest.approx(1 / 30e9)


@pytest.mark.parametrize("preset, per_node", [("dgx-a100", 190e9), ("dgx-h100", 380e9)])
def test_a_data_parallel_ring_over_whole_nodes_reaches_nccls_measured_bus_bandwidth(preset, per_node):
    """docs/hardware-sources.md: NCCL's all-reduce across DGX nodes with 8 NICs, about 190 GB/s
    bus bandwidth per node on A100 and 380 on H100 (the presets' per-rail figures are those / 8);
    a ring priced on one rail gave an eighth of it."""
    c = preset_cluster(preset, num_nodes=8)
    size = 2**30
    seconds = group_links(1, 1, 64, c).dp_cp_groups.all_reduce_s(size)[0, 0]
    assert 2 * 63 / 64 * size / seconds == pytest.approx(per_node, rel=0.05)


def test_p2p_is_the_slowest_tp_ranks_link_and_wraps():
    c = cluster(2, 4)
    links = group_links(2, 2, 2, c)                    # stage 0 on node 0, stage 1 on node 1
    c2 = cluster(2, 4, cross_rail=0.1)                 # stage 0 -> 1 is rail to rail: unaffected
    assert np.array_equal(group_links(2, 2, 2, c2).p2p_s(1e8), links.p2p_s(1e8))
    c2 = dataclasses.replace(c2, name="slow", intra_node=(dense(c2.intra_node[0]), dense(c2.intra_node[0])),
                             node_class=np.array([0, 1]))
    c2.intra_node[1].bandwidth_Bps[1, 3] = 1e8          # would matter only inside node 1
    assert np.array_equal(group_links(2, 2, 2, c2).p2p_s(1e8), links.p2p_s(1e8))
    order = np.array([0, 1, 2, 3, 5, 4, 6, 7])         # node 1's local ranks 0 and 1 swapped: cross-rail hops
    slow = group_links(2, 2, 2, c2, order)
    fast, crossed = links.p2p_s(1e8).activation, slow.p2p_s(1e8).activation
    assert fast.shape == (2, 2)                        # (dp, hop)
    assert crossed[0, 0] > fast[0, 0] * 5              # the slow (cross-rail) TP rank sets the hop's time
    assert crossed[1, 0] == fast[1, 0]                 # the other replica is untouched
    assert fast[0, 1] == fast[0, 0]                    # hop 1 wraps 1 -> 0 across nodes too


def test_slowest_device_sets_the_tensor_group_pace():
    c = cluster(1, 8)
    c.gemm_flops[5] = 50e12
    links = group_links(4, 2, 1, c)
    assert links.gemm_flops[1, 0] == 50e12 and links.gemm_flops[0, 0] == 200e12


def test_expert_all_to_alls_shared_by_grids_of_one_ep_and_etp_are_each_grids_own():
    """The cost model computes the expert-parallel all-to-alls once per (EP, ETP) and hands them to
    every grid that shares them: each grid gets what its own (pp, edp, ep, etp) groups give."""
    import dataclasses

    from megatron_pipette.cost.comm import _worst_per_stage, all_to_all, expert_dispatch, group_links
    from megatron_pipette.spec.hardware import preset_cluster

    base = preset_cluster("dgx-h100", num_nodes=4)
    bandwidth = base.inter_node.bandwidth_Bps.copy()
    bandwidth[1, :] /= 4                                      # one slow node, so the groups differ
    cluster = dataclasses.replace(base, inter_node=LinkLevel(bandwidth_Bps=bandwidth,
                                                             latency_s=base.inter_node.latency_s))
    shared = expert_dispatch(np.arange(32), 8, 2, cluster)            # EP groups across two nodes
    for tp, pp, dp in ((2, 2, 8), (2, 1, 16), (8, 2, 2)):
        grid = np.arange(32).reshape(pp, -1, 8, 2)
        own = _worst_per_stage(all_to_all(grid.transpose(0, 1, 3, 2), cluster), (1, 2))
        given = group_links(tp, pp, dp, cluster, ep=8, etp=2, experts=True, dispatch=shared).experts.dispatch
        assert np.array_equal(own.alpha_s, given.alpha_s) and np.array_equal(own.inv_bw_s_per_B, given.inv_bw_s_per_B)
        assert given.inv_bw_s_per_B.shape == (pp,)
        assert pp == 1 or given.inv_bw_s_per_B[0] > given.inv_bw_s_per_B[1]      # stage 0 holds the slow node
