"""Building the cluster document from per-rank reports: pure numpy, no processes."""

import math

import numpy as np
import pytest

from megatron_pipette.errors import PipetteError
from megatron_pipette.probe.budget import RoundConfig
from megatron_pipette.probe.document import (RankReport, alpha_beta, build_document, fill_unmeasured,
                                             gpus_per_node, medium_bytes, merge_collectives, pair_times,
                                             sender_times, two_way_alpha_beta)
from megatron_pipette.probe.schedule import tournament
from megatron_pipette.spec.cluster_file import cluster_from_json

NAN = math.nan
S, L = 4096, 4 * 2**20


def test_gpus_per_node_from_hosts():
    assert gpus_per_node(["a"] * 4) == 4
    assert gpus_per_node(["a", "a", "b", "b"]) == 2
    for bad in (["a", "b", "a", "b"], ["a", "a", "a", "b"], ["a", "b", "b"]):
        with pytest.raises(PipetteError, match="consecutive"):
            gpus_per_node(bad)


def test_pair_times_take_the_smaller_side_and_are_symmetric():
    t = pair_times([[NAN, 2.0, NAN], [3.0, NAN, NAN], [NAN, NAN, NAN]])
    assert t[0, 1] == t[1, 0] == 2.0
    assert np.isnan(t[0, 2]) and np.isnan(t[0, 0])


def test_sender_times_keep_each_direction():
    t = sender_times([[NAN, 2.0], [3.0, NAN]])
    assert t[0, 1] == 2.0 and t[1, 0] == 3.0 and np.isnan(t[0, 0])


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
    assert m == 128 * 2**10 and medium_bytes(4096, 64 * 2**20) == 512 * 2**10
    one_way, alpha = np.array([[np.inf, 1e8], [2e8, np.inf]]), np.array([[0.0, 1e-3], [1e-3, 0.0]])
    # half duplex, and a medium exchange that loses 20 ms more (acknowledgements behind data)
    tm, tl = pair_times([[NAN, 0.021 + m / 0.5e8], [NAN, NAN]]), pair_times([[NAN, 0.021 + L / 0.5e8], [NAN, NAN]])
    bw, lat = two_way_alpha_beta(tm, tl, m, L, one_way, alpha)
    np.testing.assert_allclose(bw[[0, 1], [1, 0]], [0.5e8, 0.5e8])
    np.testing.assert_allclose(lat[[0, 1], [1, 0]], [0.021, 0.021])
    # full duplex: never above the one-way rate (the exchange ends with the slower direction),
    # and never below the one-way latency
    tm, tl = pair_times([[NAN, m / 1e8], [NAN, NAN]]), pair_times([[NAN, L / 1e8], [NAN, NAN]])
    bw, lat = two_way_alpha_beta(tm, tl, m, L, one_way, alpha)
    np.testing.assert_allclose(bw[[0, 1], [1, 0]], [1e8, 1e8])
    np.testing.assert_allclose(lat[[0, 1], [1, 0]], [1e-3, 1e-3])


def test_fill_uses_same_kind_median():
    n, gpn = 4, 2
    m = np.full((n, n), NAN)
    m[0, 1] = m[1, 0] = 100.0      # intra
    m[0, 2] = m[2, 0] = 10.0       # inter
    m[1, 3] = m[3, 1] = 30.0       # inter
    m[1, 2] = 40.0                 # one direction measured: only the other is filled
    out, filled = fill_unmeasured(m, gpn)
    assert out[2, 3] == out[3, 2] == 100.0                 # intra from intra
    assert out[0, 3] == out[3, 0] == out[2, 1] == 30.0     # inter from inter (10, 10, 30, 30, 40)
    assert out[1, 2] == 40.0
    assert sorted(filled) == [[0, 3], [1, 2], [2, 3]]
    with pytest.raises(PipetteError, match="no pair"):
        fill_unmeasured(np.full((2, 2), NAN), 2)


def test_merge_collectives_keeps_the_slowest_member():
    recs = merge_collectives([[{"op": "all_reduce", "ranks": [0, 1], "bytes": 100, "time_s": 1.0}],
                              [{"op": "all_reduce", "ranks": [0, 1], "bytes": 100, "time_s": 2.0}]])
    assert recs == [{"op": "all_reduce", "ranks": [0, 1], "bytes": 100, "time_s": 2.0, "busbw_Bps": 50.0}]


def _report(rank, n, host, small, large):
    ident = {"host": host, "local_rank": None, "local_world_size": None, "host_memory_bytes": 8 * 2**30,
             "device_name": "cpu", "gpu": None, "memory_bytes": None}
    return RankReport(identity=ident, gemm_flops=1e10 * (rank + 1), memory_bandwidth_Bps=5e9,
                      small_s=small, large_s=large, exchange_s=large, exchange_medium_s=small, collectives=[])


def test_document_with_skipped_rounds_is_complete_and_accepted():
    n = 4
    rounds = tournament(n)
    configs = [RoundConfig(5, True), RoundConfig(2, False), None]   # round 2 dropped by the budget
    small = [[NAN] * n for _ in range(n)]
    large = [[NAN] * n for _ in range(n)]
    for k, cfg in enumerate(configs):
        if cfg is None:
            continue
        for a, b in rounds[k]:
            small[a][b] = small[b][a] = 1e-4
            if cfg.large:
                large[a][b] = large[b][a] = 1e-4 + L / 2e9
    reports = [_report(r, n, "h0" if r < 2 else "h1", small[r], large[r]) for r in range(n)]
    doc = build_document(reports, name="t", precision="fp32", small_bytes=S, large_bytes=L,
                         round_configs=configs, max_repeats=5, probe_meta={"backend": "gloo"})
    cluster = cluster_from_json(doc)
    assert cluster.num_nodes == 2 and doc["gpus_per_node"] == 2
    assert doc["devices"][3]["memory_bytes"] == 4 * 2**30 and doc["devices"][3]["local_rank"] == 1
    bw = np.array([[0 if v is None else v for v in row] for row in doc["bandwidth_Bps"]])
    assert np.allclose(bw, bw.T) and (bw + np.eye(n) > 0).all()
    whats = {s["what"]: s for s in doc["probe"]["skipped"]}
    assert set(whats) == {"repeats", "large_message", "rounds"}
    assert whats["rounds"]["pairs"] == [list(p) for p in rounds[2]]
    assert doc["probe"]["rounds"] == 3 and doc["probe"]["rounds_measured"] == 2
