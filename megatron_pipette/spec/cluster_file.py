"""The measured-cluster JSON schema (version 1), as pure dict <-> Cluster functions.

The in-job probe writes this document and `pipette plan --cluster FILE` reads
it. Callers do the file I/O; see docs/cluster-schema.md for the field list.

    {
      "schema": "megatron-pipette/cluster", "version": 1,
      "name": "probe-2026-11-22T05:00:00Z",
      "precision": "bf16",
      "gpus_per_node": 8,
      "devices": [{"rank": 0, "host": "node0", "local_rank": 0,
                   "device_name": "NVIDIA H100 80GB HBM3", "gpu": "H100-80GB",
                   "memory_bytes": 85520809984, "memory_bandwidth_Bps": 3.0e12,
                   "gemm_flops": 7.9e14}, ...],
      "bandwidth_Bps": [[null, 3.7e11, ...], ...],
      "latency_s": [[null, 6e-06, ...], ...],
      "exchange_bandwidth_Bps": [[null, 3.6e11, ...], ...],     (optional; default: bandwidth_Bps)
      "exchange_latency_s": [[null, 8e-06, ...], ...],          (optional; default: latency_s)
      "collectives": [{"op": "all_reduce", "ranks": [0, 1], "bytes": 67108864,
                       "time_s": 0.0004, "busbw_Bps": 1.7e11}],
      "probe": {"backend": "nccl", "duration_s": 4.2, "rounds": 7, "skipped": []}
    }
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.hardware import Cluster, gpu_catalog

SCHEMA = "megatron-pipette/cluster"
VERSION = 1


def _matrix(data: dict, key: str, n: int, where: str) -> np.ndarray:
    rows = data.get(key)
    if not isinstance(rows, list) or len(rows) != n or any(not isinstance(r, list) or len(r) != n for r in rows):
        raise PipetteError(f"{where}: '{key}' must be a {n}x{n} matrix")
    m = np.array([[np.nan if v is None else v for v in row] for row in rows], dtype=float)
    off = ~np.eye(n, dtype=bool)
    if not np.all(np.isfinite(m[off])) or np.any(m[off] < 0):
        raise PipetteError(f"{where}: '{key}' has a missing, negative or non-finite off-diagonal entry")
    np.fill_diagonal(m, 0.0 if key.endswith("latency_s") else np.inf)
    return m


def _optional_matrix(data: dict, key: str, n: int, where: str) -> np.ndarray | None:
    return None if data.get(key) is None else _matrix(data, key, n, where)


def cluster_from_json(data: Any, where: str = "--cluster") -> Cluster:
    """Validate a cluster document and build the Cluster it describes."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise PipetteError(f"{where}: not a megatron-pipette cluster file (missing \"schema\": \"{SCHEMA}\")")
    if data.get("version") != VERSION:
        raise PipetteError(f"{where}: cluster schema version {data.get('version')!r} is not supported "
                           f"(this pipette reads version {VERSION})")
    devices = data.get("devices")
    if not isinstance(devices, list) or not devices:
        raise PipetteError(f"{where}: 'devices' must be a non-empty list")
    devices = sorted(devices, key=lambda d: d.get("rank", -1))
    n = len(devices)
    if [d.get("rank") for d in devices] != list(range(n)):
        raise PipetteError(f"{where}: device ranks must be 0..{n - 1}, each once")
    gpn = data.get("gpus_per_node")
    if not isinstance(gpn, int) or gpn <= 0 or n % gpn:
        raise PipetteError(f"{where}: gpus_per_node {gpn!r} must be a positive divisor of {n} devices")
    hosts = []
    for node in range(n // gpn):
        names = {d.get("host") for d in devices[node * gpn:(node + 1) * gpn]}
        if len(names) != 1:
            raise PipetteError(f"{where}: ranks {node * gpn}..{(node + 1) * gpn - 1} should share one host "
                               f"(torchrun places consecutive ranks on a node), found {sorted(map(str, names))}")
        hosts.append(str(names.pop()))
    for d in devices:
        for key in ("memory_bytes", "gemm_flops"):
            if not isinstance(d.get(key), (int, float)) or d[key] <= 0:
                raise PipetteError(f"{where}: device {d['rank']} needs a positive '{key}'")
    names = {d.get("gpu") for d in devices}
    gpu = gpu_catalog().get(str(names.pop()).lower()) if len(names) == 1 else None
    mem_bw = [d.get("memory_bandwidth_Bps") for d in devices]
    if all(isinstance(b, (int, float)) and b > 0 for b in mem_bw):
        memory_bandwidth = float(min(mem_bw))
    elif gpu is not None:
        memory_bandwidth = gpu.memory_bandwidth_Bps
    else:
        raise PipetteError(f"{where}: devices need 'memory_bandwidth_Bps' when 'gpu' is not a catalog GPU")
    return Cluster(name=str(data.get("name", "probed")), num_nodes=n // gpn, gpus_per_node=gpn,
                   memory_bytes=int(min(d["memory_bytes"] for d in devices)),
                   memory_bandwidth_Bps=memory_bandwidth,
                   gemm_flops=np.array([float(d["gemm_flops"]) for d in devices]),
                   bandwidth_Bps=_matrix(data, "bandwidth_Bps", n, where),
                   latency_s=_matrix(data, "latency_s", n, where),
                   exchange_bandwidth_Bps=_optional_matrix(data, "exchange_bandwidth_Bps", n, where),
                   exchange_latency_s=_optional_matrix(data, "exchange_latency_s", n, where),
                   gpu=gpu, hosts=tuple(hosts))


def cluster_to_json(cluster: Cluster, precision: str = "bf16") -> dict:
    """The schema document for a Cluster (presets exported for editing, tests)."""
    n = cluster.world_size

    def matrix(m: np.ndarray) -> list[list[float | None]]:
        return [[None if i == j else float(m[i, j]) for j in range(n)] for i in range(n)]

    hosts = cluster.hosts or tuple(f"node{k}" for k in range(cluster.num_nodes))
    exchange = {key: matrix(m) for key, m in (("exchange_bandwidth_Bps", cluster.exchange_bandwidth_Bps),
                                              ("exchange_latency_s", cluster.exchange_latency_s)) if m is not None}
    return {
        "schema": SCHEMA, "version": VERSION, "name": cluster.name, "precision": precision,
        "gpus_per_node": cluster.gpus_per_node,
        "devices": [{"rank": i, "host": hosts[cluster.node_of(i)], "local_rank": i % cluster.gpus_per_node,
                     "device_name": cluster.gpu.name if cluster.gpu else "unknown",
                     "gpu": cluster.gpu.name if cluster.gpu else None,
                     "memory_bytes": cluster.memory_bytes,
                     "memory_bandwidth_Bps": cluster.memory_bandwidth_Bps,
                     "gemm_flops": float(cluster.gemm_flops[i])} for i in range(n)],
        "bandwidth_Bps": matrix(cluster.bandwidth_Bps),
        "latency_s": matrix(cluster.latency_s),
        **exchange,
    }
