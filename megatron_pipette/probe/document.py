"""Turn the probe's measurements into the cluster document (schema version 2; pure, no torch).

Why separate: the root builds the document from plain data, so the arithmetic (the fits in
`probe.fit`, the device list, what the budget skipped) is testable without processes, and
the probe twin builds its document with exactly this code. See docs/cluster-schema.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_pipette.errors import PipetteError
from megatron_pipette.probe import fit
from megatron_pipette.probe.engine import Measurements, PhaseResult
from megatron_pipette.probe.schedule import ALL_TO_ALL_NODES
from megatron_pipette.spec.cluster_file import cluster_document
from megatron_pipette.spec.hardware import Cluster, LinkLevel


def gpus_per_node(hosts: Sequence[str]) -> int:
    """Ranks per node, from the node name of each rank in rank order.

    The schema (and Megatron's rank layout) needs nodes of equal size holding
    consecutive ranks, which is what torchrun produces; anything else is a
    launch the planner cannot describe, so it is a user error.
    """
    n = len(hosts)
    if n == 0:
        raise PipetteError("probe: no ranks")
    size = 1
    while size < n and hosts[size] == hosts[0]:
        size += 1
    blocks = [hosts[k:k + size] for k in range(0, n, size)]
    if n % size or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
        layout = ", ".join(f"{h}" for h in hosts[: min(n, 16)]) + (" ..." if n > 16 else "")
        raise PipetteError(f"probe: ranks must sit on nodes in equal blocks of consecutive ranks "
                           f"(as torchrun places them); host of each rank: {layout}")
    return size


def _devices(identities: Sequence[dict], m: Measurements) -> dict:
    """Per-device vectors; on CPU a rank's memory is its host's divided among the ranks on it."""
    memory = []
    for ident in identities:
        mem = ident.get("memory_bytes")
        if mem is None:
            mem = int(ident["host_memory_bytes"]) // int(ident.get("local_world_size") or m.gpus_per_node)
        memory.append(int(mem))
    return {"memory_bytes": memory, "memory_bandwidth_Bps": m.copy_Bps.tolist(), "gemm_flops": m.gemm_flops.tolist()}


def _skips(phase: PhaseResult, name: str, max_repeats: int, filled: str) -> list[dict]:
    """What the budget left out of one phase, compactly (counts, not pairs)."""
    ran = [c for c in phase.configs if c is not None]
    skipped: list[dict] = []
    cut = [c.repeats for c in ran if c.repeats < max_repeats]
    if cut:
        skipped.append({"what": "repeats", "phase": name, "rounds": len(cut), "fewest": min(cut),
                        "reason": f"budget: {len(cut)} of {len(phase.rounds)} {name} rounds ran fewer than "
                                  f"{max_repeats} repeats (as few as {min(cut)})"})
    small_only = sum(not c.large for c in ran)
    if small_only:
        skipped.append({"what": "large_message", "phase": name, "rounds": small_only,
                        "reason": f"budget: {small_only} {name} rounds timed the small message only; "
                                  f"their bandwidth is {filled}"})
    dropped = len(phase.rounds) - len(ran)
    if dropped:
        skipped.append({"what": "rounds", "phase": name, "rounds": dropped,
                        "reason": f"budget: {dropped} of {len(phase.rounds)} {name} rounds not run; "
                                  f"their links are {filled}"})
    return skipped


def _level(figures: fit.Figures) -> LinkLevel:
    """The fitted figures are LinkLevel's, field for field (no copy of the matrices)."""
    return LinkLevel(**{f.name: getattr(figures, f.name) for f in dataclasses.fields(figures)})


def _all_to_all(m: Measurements, links: Cluster) -> tuple[float, dict | None, list[dict]]:
    """(the cluster's all-to-all factor, the probe block's report of it, what the budget skipped)."""
    if m.all_to_all is None:
        return 1.0, None, []
    got = fit.all_to_all_fit(m.all_to_all, links)
    report = {"nodes_per_block": ALL_TO_ALL_NODES, "bytes_per_peer": m.all_to_all.bytes_per_peer,
              "repeats": int(m.all_to_all.block_s.shape[1]),
              "bandwidth_factor": None if got is None else got.factor,
              "block_share": None if got is None else [None if np.isnan(x) else round(x, 4) for x in got.block_share]}
    if m.all_to_all.block_s.shape[1] == 0:
        return 1.0, report, [{"what": "all_to_all", "phase": "all-to-all", "rounds": 1,
                              "reason": "budget: the all-to-all did not run; its bandwidth factor is 1, assumed"}]
    return (1.0 if got is None else got.factor), report, []


def build_document(m: Measurements, identities: Sequence[dict], *, name: str, precision: str, small_bytes: int,
                   large_bytes: int, max_repeats: int, probe_meta: dict[str, Any],
                   extra_skipped: Sequence[dict] = ()) -> dict:
    """The cluster document (schema version 2) from the root's measurements and every rank's identity."""
    classes, node_class = fit.intra_levels(m, small_bytes, large_bytes) if m.gpus_per_node > 1 else (None, None)
    if classes is None:   # one GPU per node: nothing inside a node to measure
        one = np.zeros((1, 1))
        classes, node_class = [fit.Figures(one + np.inf, one, one + np.inf, one)], np.zeros(m.num_nodes, int)
    inter = fit.inter_level(m, small_bytes, large_bytes)
    # NVLink domains spanning hosts are told apart from the network by their speed; gloo on CPU
    # has no NVLink, and its loopback inside and between emulated nodes runs alike.
    on_gpu = any(ident.get("device_name", "cpu") != "cpu" for ident in identities)
    domain = fit.domains(inter, classes, node_class) if on_gpu else None
    hosts = [identities[k * m.gpus_per_node]["host"] for k in range(m.num_nodes)]
    gpus = {ident.get("gpu") for ident in identities}
    devices = _devices(identities, m)
    links = Cluster(name=name, num_nodes=m.num_nodes, gpus_per_node=m.gpus_per_node,
                    memory_bytes=min(devices["memory_bytes"]), memory_bandwidth_Bps=float(m.copy_Bps.min()),
                    gemm_flops=m.gemm_flops, intra_node=tuple(_level(c) for c in classes),
                    node_class=np.asarray(node_class), inter_node=_level(inter.figures),
                    cross_rail_bandwidth_factor=inter.cross_rail_bandwidth_factor,
                    cross_rail_latency_s=inter.cross_rail_latency_s, domain_of_node=domain)
    all_to_all, all_to_all_report, all_to_all_skipped = _all_to_all(m, links)
    skipped = (_skips(m.intra, "intra-node", max_repeats, "the median of the node's measured links")
               + _skips(m.inter, "inter-node", max_repeats, "filled from the per-node fit") + all_to_all_skipped
               + list(extra_skipped))
    return cluster_document(
        name=name, precision=precision, gpu=gpus.pop() if len(gpus) == 1 else None,
        device_name=identities[0].get("device_name", "unknown"), hosts=hosts, node_class=node_class,
        domains=domain if domain is not None else range(m.num_nodes), devices=devices,
        intra_node=classes, inter_node=inter.figures, cross_rail_bandwidth_factor=inter.cross_rail_bandwidth_factor,
        cross_rail_latency_s=inter.cross_rail_latency_s, all_to_all_bandwidth_factor=all_to_all,
        probe={**probe_meta, "world_size": m.world_size, "duration_s": round(m.duration_s, 4),
               "intra_rounds": len(m.intra.rounds), "intra_rounds_measured": m.intra.measured,
               "inter_rounds": len(m.inter.rounds), "inter_rounds_measured": m.inter.measured,
               "node_pairs_measured": int(inter.measured.sum()) // 2,
               "round_times_s": {"intra": [round(t, 6) for t in m.intra.round_times_s],
                                 "inter": [round(t, 6) for t in m.inter.round_times_s]},
               "small_bytes": int(small_bytes), "large_bytes": int(large_bytes),
               "exchange_bytes": [fit.medium_bytes(small_bytes, large_bytes), int(large_bytes)],
               "repeats": int(max_repeats), "skipped": skipped,
               "slow_links": inter.slow_links, "slow_nodes": inter.slow_nodes, "all_to_all": all_to_all_report,
               "fit": None if m.num_nodes == 1 else {
                   "fabric_Bps": inter.fabric_Bps, "node_out_rate_Bps": inter.out_rate_Bps.tolist(),
                   "node_in_rate_Bps": inter.in_rate_Bps.tolist()}},
        node_gpus=[[ident.get("gpu_id") for ident in identities[k * m.gpus_per_node:(k + 1) * m.gpus_per_node]]
                   for k in range(m.num_nodes)],
        measured=inter.measured)
