"""The measured-cluster JSON schema (version 2), as pure dict <-> Cluster functions.

The in-job probe writes this document and `pipette plan --cluster FILE` reads it;
docs/cluster-schema.md lists every field. Callers do the file I/O. Version 1
files (a GPU x GPU matrix per figure) still load, converted (`_from_version_1`).

    {
      "schema": "megatron-pipette/cluster", "version": 2,
      "name": "probe-2026-11-22T05:00:00Z", "precision": "bf16",
      "num_nodes": 2, "gpus_per_node": 8,
      "gpu": "H100-80GB", "device_name": "NVIDIA H100 80GB HBM3",
      "nodes": [{"host": "node0", "class": 0, "domain": 0, "gpus": ["GPU-8f2e...", ...]}, ...],
      "devices": {"memory_bytes": [...], "memory_bandwidth_Bps": [...], "gemm_flops": [...]},
      "intra_node": [{"bandwidth_Bps": G x G, "latency_s": G x G,
                      "exchange_bandwidth_Bps": G x G, "exchange_latency_s": G x G,
                      "batched_exchange_bandwidth_Bps": G x G, "batched_exchange_latency_s": G x G}],
      "inter_node": {"bandwidth_Bps": N x N, "latency_s": N x N, ...,
                     "cross_rail_bandwidth_factor": 0.9, "cross_rail_latency_s": 2e-6,
                     "all_to_all_bandwidth_factor": 0.8,
                     "measured": {"bits_base64": "...", "shape": [N, N]}},
      "probe": {...}
    }

A matrix is a list of rows with null on the diagonal, or, beyond DENSE_LIST_LIMIT
endpoints, {"float32_base64": "...", "shape": [n, n]} (row-major little-endian float32,
diagonal NaN), which keeps a 2048-node file at tens of megabytes. A node's "gpus" (its local ranks'
GPU identities) and the inter-node "measured" bitmask (which node pairs the probe measured rather
than filled) let a later allocation reuse what was measured on the same machines (`ClusterFile.select`).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.expressions import in_range
from megatron_pipette.spec.hardware import Cluster, LinkLevel, check_cluster_shape, gpu_catalog

SCHEMA = "megatron-pipette/cluster"
VERSION = 2
READABLE_VERSIONS = (1, 2)
DENSE_LIST_LIMIT = 256
"""Matrices with more endpoints than this are written base64-encoded, not as nested lists."""
LEVEL_KEYS = ("bandwidth_Bps", "latency_s", "exchange_bandwidth_Bps", "exchange_latency_s",
              "batched_exchange_bandwidth_Bps", "batched_exchange_latency_s")
MIN_BANDWIDTH_BPS = 1e3
"""The slowest link or memory a file may give, bytes/s: a probe that measured less has failed
(a bandwidth of 0 or 1e-300 made every time infinite and ranked NaN plans first)."""
MAX_LATENCY_S = 10.0
"""The longest start-up time of a message a file may give: longer is a failed link, not a slow one."""
MIN_FLOPS = 1e6
"""The slowest GEMM rate a file may give, FLOP/s (per device)."""


def encode_matrix(m: np.ndarray) -> list | dict:
    """A square matrix for the document; the diagonal is unused and written as null (NaN)."""
    n = m.shape[0]
    if n > DENSE_LIST_LIMIT:
        out = np.array(m, dtype="<f4")
        np.fill_diagonal(out, np.nan)
        return {"float32_base64": base64.b64encode(out.data).decode("ascii"), "shape": [n, n]}
    rows = np.asarray(m, dtype=float).tolist()
    for i in range(n):
        rows[i][i] = None
    return rows


def encode_pairs(pairs: np.ndarray) -> dict:
    """A (n, n) bool matrix of node pairs, one bit each (row-major, numpy's packbits order)."""
    return {"bits_base64": base64.b64encode(np.packbits(pairs.astype(bool))).decode("ascii"),
            "shape": list(pairs.shape)}


def _decode_pairs(value: Any, n: int, where: str) -> np.ndarray:
    try:
        bits = np.frombuffer(base64.b64decode(value["bits_base64"], validate=True), dtype=np.uint8)
        shape = tuple(value["shape"])
    except (KeyError, TypeError, ValueError, binascii.Error):
        raise PipetteError(f"{where}: 'measured' is not a valid bit matrix") from None
    if shape != (n, n) or bits.size != -(-n * n // 8):
        raise PipetteError(f"{where}: 'measured' must be a {n}x{n} bit matrix")
    return np.unpackbits(bits, count=n * n).reshape(n, n).astype(bool)


def _decode_matrix(value: Any, key: str, n: int, where: str) -> np.ndarray:
    if isinstance(value, dict):
        try:
            raw = base64.b64decode(value["float32_base64"], validate=True)
            m = np.frombuffer(raw, dtype="<f4").astype(float).reshape(value["shape"])
        except (KeyError, TypeError, ValueError, binascii.Error):
            raise PipetteError(f"{where}: '{key}' is not a valid encoded matrix") from None
        if m.shape != (n, n):
            raise PipetteError(f"{where}: '{key}' must be a {n}x{n} matrix, got {m.shape[0]}x{m.shape[1]}")
    else:
        if not isinstance(value, list) or len(value) != n or any(not isinstance(r, list) or len(r) != n
                                                                  for r in value):
            raise PipetteError(f"{where}: '{key}' must be a {n}x{n} matrix")
        try:
            m = np.array([[np.nan if v is None else v for v in row] for row in value], dtype=float)
        except (TypeError, ValueError, OverflowError):
            raise PipetteError(f"{where}: '{key}' has a non-numeric entry") from None
    latency = key.endswith("latency_s")
    low, high = (0.0, MAX_LATENCY_S) if latency else (MIN_BANDWIDTH_BPS, np.inf)
    np.fill_diagonal(m, low)      # unused: checked with the rest, in two passes (NaN fails both)
    least, most = m.min(), m.max()
    if not (least >= low and most <= high and np.isfinite(most)):
        bound = f"above {MAX_LATENCY_S:g} s" if latency else f"below {MIN_BANDWIDTH_BPS:g} B/s"
        raise PipetteError(f"{where}: '{key}' has an off-diagonal entry that is missing, negative, non-finite "
                           f"or {bound}")
    np.fill_diagonal(m, 0.0 if latency else np.inf)
    return m


def _level(data: Any, n: int, where: str) -> LinkLevel:
    if not isinstance(data, dict):
        raise PipetteError(f"{where}: must be an object with 'bandwidth_Bps' and 'latency_s'")
    for key in LEVEL_KEYS[:2]:
        if key not in data:
            raise PipetteError(f"{where}: '{key}' is missing")
    m = {key: _decode_matrix(data[key], key, n, where) if data.get(key) is not None else None for key in LEVEL_KEYS}
    return LinkLevel(**m)


def _level_json(level: Any) -> dict:
    return {key: encode_matrix(getattr(level, key)) for key in LEVEL_KEYS if getattr(level, key) is not None}


DEVICE_MINIMA = {"memory_bytes": 1.0, "memory_bandwidth_Bps": MIN_BANDWIDTH_BPS, "gemm_flops": MIN_FLOPS}
"""The least each per-device figure may be."""


def _positive_vector(devices: dict, key: str, n: int, where: str, required: bool = True) -> np.ndarray | None:
    values = devices.get(key)
    if values is None and not required:
        return None
    if not isinstance(values, list) or len(values) != n or not all(in_range(v, DEVICE_MINIMA[key]) for v in values):
        raise PipetteError(f"{where}: devices.{key} must list a finite number of at least {DEVICE_MINIMA[key]:g} "
                           f"for each of the {n} devices")
    return np.array(values, dtype=float)


def cluster_from_json(data: Any, where: str = "--cluster") -> Cluster:
    """Validate a cluster document (version 1 or 2) and build the Cluster it describes."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise PipetteError(f"{where}: not a megatron-pipette cluster file (missing \"schema\": \"{SCHEMA}\")")
    if data.get("version") not in READABLE_VERSIONS:
        raise PipetteError(f"{where}: cluster schema version {data.get('version')!r} is not supported "
                           f"(this pipette reads versions {', '.join(map(str, READABLE_VERSIONS))})")
    if data["version"] == 1:
        return _from_version_1(data, where)
    num_nodes, gpn = data.get("num_nodes"), data.get("gpus_per_node")
    check_cluster_shape(num_nodes, gpn, (f"{where}: 'num_nodes'", f"{where}: 'gpus_per_node'"))
    n = num_nodes * gpn
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or len(nodes) != num_nodes or not all(isinstance(x, dict) for x in nodes):
        raise PipetteError(f"{where}: 'nodes' must list {num_nodes} nodes (num_nodes), "
                           f"got {len(nodes) if isinstance(nodes, list) else nodes!r}")
    intra = data.get("intra_node")
    if not isinstance(intra, list) or not intra:
        raise PipetteError(f"{where}: 'intra_node' must be a non-empty list of node classes")
    classes = [x.get("class", 0) for x in nodes]
    if any(not isinstance(c, int) or not 0 <= c < len(intra) for c in classes):
        raise PipetteError(f"{where}: every node's 'class' must index 'intra_node' (0..{len(intra) - 1})")
    domains = [x.get("domain", k) for k, x in enumerate(nodes)]
    if any(not isinstance(d, int) or d < 0 for d in domains):
        raise PipetteError(f"{where}: every node's 'domain' must be a non-negative integer")
    devices = data.get("devices")
    if not isinstance(devices, dict):
        raise PipetteError(f"{where}: 'devices' must be an object of per-device lists")
    memory = _positive_vector(devices, "memory_bytes", n, where)
    gemm = _positive_vector(devices, "gemm_flops", n, where)
    mem_bw = _positive_vector(devices, "memory_bandwidth_Bps", n, where, required=False)
    gpu = gpu_catalog().get(str(data.get("gpu")).lower()) if data.get("gpu") else None
    if mem_bw is None and gpu is None:
        raise PipetteError(f"{where}: devices need 'memory_bandwidth_Bps' when 'gpu' is not a catalog GPU")
    inter = data.get("inter_node")
    levels = tuple(_level(level, gpn, f"{where}: intra_node[{k}]") for k, level in enumerate(intra))
    factor = inter.get("cross_rail_bandwidth_factor", 1.0) if isinstance(inter, dict) else 1.0
    extra = inter.get("cross_rail_latency_s", 0.0) if isinstance(inter, dict) else 0.0
    all_to_all = inter.get("all_to_all_bandwidth_factor", 1.0) if isinstance(inter, dict) else 1.0
    if not in_range(factor, 0.0, 1.0, above=True) or not in_range(extra, 0.0, MAX_LATENCY_S):
        raise PipetteError(f"{where}: inter_node cross_rail_bandwidth_factor must be in (0, 1] and "
                           f"cross_rail_latency_s in [0, {MAX_LATENCY_S:g}]")
    if not in_range(all_to_all, 0.0, 1.0, above=True):
        raise PipetteError(f"{where}: inter_node all_to_all_bandwidth_factor must be in (0, 1], got {all_to_all!r}")
    return Cluster(name=str(data.get("name", "probed")), num_nodes=num_nodes, gpus_per_node=gpn,
                   memory_bytes=int(memory.min()),
                   memory_bandwidth_Bps=float(mem_bw.min()) if mem_bw is not None else gpu.memory_bandwidth_Bps,
                   gemm_flops=gemm, intra_node=levels, node_class=np.array(classes, dtype=np.int64),
                   inter_node=_level(inter, num_nodes, f"{where}: inter_node"),
                   cross_rail_bandwidth_factor=float(factor), cross_rail_latency_s=float(extra),
                   all_to_all_bandwidth_factor=float(all_to_all),
                   domain_of_node=None if domains == list(range(num_nodes)) else np.array(domains, dtype=np.int64),
                   gpu=gpu, hosts=tuple(str(x.get("host", f"node{k}")) for k, x in enumerate(nodes)))


def cluster_document(*, name: str, precision: str, gpu: str | None, device_name: str, hosts: Sequence[str],
                     node_class: Sequence[int], domains: Sequence[int], devices: Mapping[str, list],
                     intra_node: Sequence[Any], inter_node: Any, cross_rail_bandwidth_factor: float,
                     cross_rail_latency_s: float, all_to_all_bandwidth_factor: float,
                     probe: Mapping[str, Any] | None = None, node_gpus: Sequence[Sequence[str | None]] | None = None,
                     measured: np.ndarray | None = None) -> dict:
    """The one writer of the schema (version 2), for the probe's measurements and for a Cluster alike:
    `devices` holds the per-device lists, each level of `intra_node` and `inter_node` has the
    LEVEL_KEYS figures as attributes (a LinkLevel, the probe's fitted figures); `probe` is the
    probe's report block, absent from files not probed. `node_gpus` (each node's local ranks' GPU
    identities) and `measured` (the node pairs measured, not filled) are what a later allocation on
    the same machines reuses; files without them are never reused."""
    nodes = [{"host": host, "class": int(c), "domain": int(d)} for host, c, d in zip(hosts, node_class, domains)]
    if node_gpus is not None:
        nodes = [{**node, "gpus": list(gpus)} for node, gpus in zip(nodes, node_gpus)]
    doc = {
        "schema": SCHEMA, "version": VERSION, "name": name, "precision": precision,
        "num_nodes": len(hosts), "gpus_per_node": len(devices["gemm_flops"]) // len(hosts),
        "gpu": gpu, "device_name": device_name,
        "nodes": nodes,
        "devices": dict(devices),
        "intra_node": [_level_json(level) for level in intra_node],
        "inter_node": {**_level_json(inter_node), "cross_rail_bandwidth_factor": cross_rail_bandwidth_factor,
                       "cross_rail_latency_s": cross_rail_latency_s,
                       "all_to_all_bandwidth_factor": all_to_all_bandwidth_factor},
    }
    if measured is not None:
        doc["inter_node"]["measured"] = encode_pairs(measured)
    return doc if probe is None else {**doc, "probe": dict(probe)}


def cluster_to_json(cluster: Cluster, precision: str = "bf16") -> dict:
    """The schema document for a Cluster (presets exported for editing, the probe twin's truth)."""
    n = cluster.world_size
    return cluster_document(
        name=cluster.name, precision=precision, gpu=cluster.gpu.name if cluster.gpu else None,
        device_name=cluster.gpu.name if cluster.gpu else "unknown",
        hosts=cluster.hosts or tuple(f"node{k}" for k in range(cluster.num_nodes)),
        node_class=cluster.node_class, domains=cluster.domains,
        devices={"memory_bytes": [cluster.memory_bytes] * n, "memory_bandwidth_Bps": [cluster.memory_bandwidth_Bps] * n,
                 "gemm_flops": cluster.gemm_flops.tolist()},
        intra_node=cluster.intra_node, inter_node=cluster.inter_node,
        cross_rail_bandwidth_factor=cluster.cross_rail_bandwidth_factor,
        cross_rail_latency_s=cluster.cross_rail_latency_s,
        all_to_all_bandwidth_factor=cluster.all_to_all_bandwidth_factor)


@dataclass(frozen=True, kw_only=True)
class ProbeReport:
    """A probed file's "probe" block, as its readers use it: how it measured (None where a file leaves a
    figure out) and, by their reasons, the slow nodes and links it found and what it skipped."""

    backend: str | None
    world_size: int | None
    duration_s: float | None
    budget_s: float | None
    intra_rounds: int | None
    intra_rounds_measured: int | None
    inter_rounds: int | None
    inter_rounds_measured: int | None
    node_pairs_measured: int | None
    all_to_all_nodes_per_block: int | None
    """Nodes of each block whose all-to-all measured the file's all-to-all factor; None where it was
    not measured (one node, no time left, or blocks inside one NVLink domain)."""
    slow_nodes: tuple[str, ...]
    slow_links: tuple[str, ...]
    skipped: tuple[str, ...]

    @classmethod
    def from_json(cls, block: Mapping[str, Any]) -> ProbeReport:
        def reasons(key: str) -> tuple[str, ...]:
            return tuple(str(x.get("reason", x.get("what", x))) if isinstance(x, dict) else str(x)
                         for x in block.get(key) or ())

        all_to_all = block.get("all_to_all") or {}
        return cls(**{k: block.get(k) for k in ("backend", "world_size", "duration_s", "budget_s", "intra_rounds",
                                                "intra_rounds_measured", "inter_rounds", "inter_rounds_measured",
                                                "node_pairs_measured")},
                   all_to_all_nodes_per_block=(all_to_all.get("nodes_per_block")
                                               if all_to_all.get("bandwidth_factor") is not None else None),
                   slow_nodes=reasons("slow_nodes"), slow_links=reasons("slow_links"), skipped=reasons("skipped"))


@dataclass(frozen=True)
class NodeIdentity:
    """Which machine a node is: its host and each local rank's GPU (the UUID where torch shows it, else
    the CUDA_VISIBLE_DEVICES entry; None where neither): what must match for a measurement to be reused."""

    host: str
    gpus: tuple[str | None, ...]


def _node_identities(nodes: list[dict], gpn: int, where: str) -> tuple[NodeIdentity, ...] | None:
    """Each node's identity, or None for a file that does not record the GPUs (older files, presets)."""
    if not all("gpus" in node for node in nodes):
        return None
    for k, node in enumerate(nodes):
        gpus = node["gpus"]
        if not isinstance(gpus, list) or len(gpus) != gpn or not all(g is None or isinstance(g, str) for g in gpus):
            raise PipetteError(f"{where}: nodes[{k}].gpus must list {gpn} GPU identities (strings or null)")
    return tuple(NodeIdentity(str(node.get("host", f"node{k}")), tuple(node["gpus"])) for k, node in enumerate(nodes))


@dataclass(frozen=True)
class ClusterFile:
    """A cluster document (the probe's, its twin's, a preset exported, a file given to --cluster), typed: the
    Cluster the planner prices with and the probe's report. Its one reader is `from_json`; `document` is
    the file as written, which `to_json` gives back unchanged (`cluster_document` writes every one)."""

    cluster: Cluster
    precision: str | None
    device_name: str | None
    probe: ProbeReport | None
    document: Mapping[str, Any]
    node_identities: tuple[NodeIdentity, ...] | None = None
    """Per node, which machine it was (None: not recorded, so nothing of the file is reused)."""
    measured_pairs: np.ndarray | None = None
    """(nodes, nodes) bool: the node pairs the probe measured (the others were filled by its per-node fit);
    None where the file does not say."""

    @classmethod
    def from_json(cls, data: Any, where: str = "--cluster") -> ClusterFile:
        """Validate a cluster document (version 1 or 2): PipetteError naming `where` if it is not one."""
        cluster = cluster_from_json(data, where)
        probe = data.get("probe")
        identities = measured = None
        if data["version"] == VERSION:
            identities = _node_identities(data["nodes"], cluster.gpus_per_node, where)
            if data["inter_node"].get("measured") is not None:
                measured = _decode_pairs(data["inter_node"]["measured"], cluster.num_nodes, f"{where}: inter_node")
        return cls(cluster, data.get("precision"), data.get("device_name"),
                   ProbeReport.from_json(probe) if isinstance(probe, dict) and probe else None, data,
                   identities, measured)

    def to_json(self) -> dict[str, Any]:
        return dict(self.document)

    def nodes_of(self, wanted: Sequence[NodeIdentity]) -> list[int | None]:
        """Where each of `wanted` is among this file's nodes (None: not measured here)."""
        index = {ident: k for k, ident in enumerate(self.node_identities or ())}
        return [index.get(ident) for ident in wanted]

    def select(self, nodes: Sequence[int], name: str) -> ClusterFile:
        """The file of an allocation made of some of this file's nodes, in that order (its node k is
        this file's node nodes[k]): every figure measured or fitted for them, kept as it is, and which
        of their pairs were measured. No probe ran for it: its probe block says where it came from."""
        cluster = select_nodes(self.cluster, nodes, name)
        idx = np.asarray(nodes, dtype=np.int64)
        ranks = (idx[:, None] * cluster.gpus_per_node + np.arange(cluster.gpus_per_node)).ravel()
        devices = self.document["devices"]
        kept = {key: np.asarray(values)[ranks].tolist() for key, values in devices.items()} \
            if isinstance(devices, dict) else {"memory_bytes": [cluster.memory_bytes] * ranks.size,
                                               "memory_bandwidth_Bps": [cluster.memory_bandwidth_Bps] * ranks.size,
                                               "gemm_flops": cluster.gemm_flops.tolist()}
        cluster = replace(cluster, memory_bytes=int(min(kept["memory_bytes"])))   # the reader's: the smallest kept
        if kept.get("memory_bandwidth_Bps") is not None:
            cluster = replace(cluster, memory_bandwidth_Bps=float(min(kept["memory_bandwidth_Bps"])))
        identities = None if self.node_identities is None else tuple(self.node_identities[k] for k in idx)
        measured = None if self.measured_pairs is None else self.measured_pairs[np.ix_(idx, idx)]
        used = np.unique(self.cluster.node_class[idx])
        doc = cluster_document(
            name=name, precision=self.precision or "bf16", gpu=cluster.gpu.name if cluster.gpu else None,
            device_name=self.device_name or "unknown", hosts=cluster.hosts, node_class=cluster.node_class,
            domains=cluster.domains, devices=kept, intra_node=[self.cluster.intra_node[k] for k in used],
            inter_node=cluster.inter_node, cross_rail_bandwidth_factor=cluster.cross_rail_bandwidth_factor,
            cross_rail_latency_s=cluster.cross_rail_latency_s,
            all_to_all_bandwidth_factor=cluster.all_to_all_bandwidth_factor,
            probe={"backend": "reused", "reused_from": self.cluster.name, "world_size": int(ranks.size),
                   "duration_s": 0.0, "node_pairs_measured": None if measured is None else int(measured.sum()) // 2},
            node_gpus=None if identities is None else [ident.gpus for ident in identities], measured=measured)
        return ClusterFile(cluster, self.precision, self.device_name, ProbeReport.from_json(doc["probe"]), doc,
                           identities, measured)


    def with_known(self, before: ClusterFile, where: Sequence[int | None]) -> ClusterFile:
        """This file (a probe of an allocation some of whose nodes `before` measured: node k is before's
        node where[k], None for a new one), with before's figures and measured flags for the pairs of
        known nodes this probe did not measure (it skips them: probe.schedule), not its own fill."""
        c, n = self.cluster, self.cluster.num_nodes
        known = np.array([w is not None for w in where])
        old = np.array([0 if w is None else w for w in where], dtype=np.int64)
        take = known[:, None] & known[None, :] & ~np.eye(n, dtype=bool)
        if self.measured_pairs is not None:
            take &= ~self.measured_pairs
        figures = {}
        for key in LEVEL_KEYS:
            mine, theirs = getattr(c.inter_node, key), getattr(before.cluster.inter_node, key)
            if mine is not None:
                figures[key] = np.array(mine, dtype=float)
                if theirs is not None:
                    figures[key][take] = theirs[np.ix_(old, old)][take]
        inter = LinkLevel(**figures)
        measured = self.measured_pairs
        if measured is not None and before.measured_pairs is not None:
            measured = measured | (take & before.measured_pairs[np.ix_(old, old)])
        probe = {**(self.document.get("probe") or {}), "reused_from": before.cluster.name,
                 "node_pairs_reused": int(take.sum()) // 2}
        doc = {**self.document, "inter_node": {**self.document["inter_node"], **_level_json(inter)}, "probe": probe}
        if measured is not None:
            doc["inter_node"]["measured"] = encode_pairs(measured)
        return ClusterFile(replace(c, inter_node=inter), self.precision, self.device_name, ProbeReport.from_json(probe),
                           doc, self.node_identities, measured)


def select_nodes(cluster: Cluster, nodes: Sequence[int], name: str) -> Cluster:
    """The cluster of some of `cluster`'s nodes, in that order (node k is its node nodes[k]): their
    devices, classes, links and domains, unchanged (an allocation after a loss, or a planned one)."""
    idx = np.asarray(nodes, dtype=np.int64)
    g = cluster.gpus_per_node
    ranks = (idx[:, None] * g + np.arange(g)).ravel()
    used, node_class = np.unique(cluster.node_class[idx], return_inverse=True)
    domain = np.unique(cluster.domains[idx], return_inverse=True)[1]
    inter = LinkLevel(**{key: getattr(cluster.inter_node, key)[np.ix_(idx, idx)] for key in LEVEL_KEYS
                         if getattr(cluster.inter_node, key) is not None})
    return replace(cluster, name=name, num_nodes=idx.size, gemm_flops=cluster.gemm_flops[ranks],
                   intra_node=tuple(cluster.intra_node[k] for k in used), node_class=node_class.astype(np.int64),
                   inter_node=inter,
                   domain_of_node=None if np.unique(domain).size == idx.size else domain.astype(np.int64),
                   hosts=tuple(cluster.hosts[k] for k in idx) if cluster.hosts else
                   tuple(f"node{k}" for k in idx))


def _from_version_1(data: dict, where: str) -> Cluster:
    """The Cluster of a version-1 document (one GPU x GPU matrix per figure).

    Inside a node the GPU matrices are kept, one class per distinct block. Between nodes a
    node pair gets its slowest rail (the largest time over local rank k -> k, as a pipeline
    hop or a DP ring sees it) and cross-rail pairs a fabric-wide factor: the median ratio of
    their bandwidth to their rails'. Lossless for node-structured files (presets, anything
    this package wrote); per-GPU detail between nodes beyond that is averaged away.
    """
    devices = data.get("devices")
    if not isinstance(devices, list) or not devices or not all(isinstance(d, dict) for d in devices):
        raise PipetteError(f"{where}: 'devices' must be a non-empty list of objects")
    n = len(devices)
    ranks = [d.get("rank") for d in devices]
    if not all(isinstance(r, int) for r in ranks) or sorted(ranks) != list(range(n)):
        raise PipetteError(f"{where}: device ranks must be 0..{n - 1}, each once")
    devices = sorted(devices, key=lambda d: d["rank"])
    gpn = data.get("gpus_per_node")
    if not isinstance(gpn, int) or isinstance(gpn, bool) or gpn <= 0 or n % gpn:
        raise PipetteError(f"{where}: gpus_per_node {gpn!r} must be a positive divisor of {n} devices")
    num_nodes = n // gpn
    check_cluster_shape(num_nodes, gpn, (f"{where}: the node count", f"{where}: 'gpus_per_node'"))
    hosts = []
    for node in range(num_nodes):
        names = {str(d.get("host")) for d in devices[node * gpn:(node + 1) * gpn]}
        if len(names) != 1:
            raise PipetteError(f"{where}: ranks {node * gpn}..{(node + 1) * gpn - 1} should share one host "
                               f"(torchrun places consecutive ranks on a node), found {sorted(map(str, names))}")
        hosts.append(str(names.pop()))
    for d in devices:
        for key in ("memory_bytes", "gemm_flops"):
            if not in_range(d.get(key), DEVICE_MINIMA[key]):
                raise PipetteError(f"{where}: device {d['rank']} needs a finite '{key}' of at least "
                                   f"{DEVICE_MINIMA[key]:g}")
    names = {str(d.get("gpu")) for d in devices}
    full = {key: _decode_matrix(data[key], key, n, where) for key in LEVEL_KEYS if data.get(key) is not None}
    if "bandwidth_Bps" not in full or "latency_s" not in full:
        raise PipetteError(f"{where}: 'bandwidth_Bps' and 'latency_s' are required")
    blocks = {key: m.reshape(num_nodes, gpn, num_nodes, gpn) for key, m in full.items()}
    classes: list[dict] = []
    node_class = []
    for a in range(num_nodes):
        block = {key: b[a, :, a, :] for key, b in blocks.items()}
        match = next((k for k, c in enumerate(classes) if all(np.array_equal(c[key], block[key]) for key in block)),
                     None)
        if match is None:
            classes.append(block)
            match = len(classes) - 1
        node_class.append(match)
    rail = np.arange(gpn)
    inter: dict[str, Any] = {}
    for key, b in blocks.items():
        per_rail = b[:, rail, :, rail]                   # (gpn, nodes, nodes): local k -> local k
        inter[key] = per_rail.max(axis=0) if key.endswith("latency_s") else per_rail.min(axis=0)
    factor, extra = 1.0, 0.0
    if num_nodes > 1 and gpn > 1:
        off_node = ~np.eye(num_nodes, dtype=bool)
        cross = ~np.eye(gpn, dtype=bool)
        bw = blocks["bandwidth_Bps"].transpose(0, 2, 1, 3)[off_node]        # (pairs, gpn, gpn)
        lat = blocks["latency_s"].transpose(0, 2, 1, 3)[off_node]
        rail_bw = inter["bandwidth_Bps"][off_node][:, None, None]
        rail_lat = inter["latency_s"][off_node][:, None, None]
        factor = float(min(1.0, np.median((bw / rail_bw)[:, cross])))
        extra = float(max(0.0, np.median((lat - rail_lat)[:, cross])))

    mem_bw = [d.get("memory_bandwidth_Bps") for d in devices]
    gpu = gpu_catalog().get(str(names.pop()).lower()) if len(names) == 1 else None
    if all(in_range(b, MIN_BANDWIDTH_BPS) for b in mem_bw):
        memory_bandwidth = float(min(mem_bw))
    elif gpu is not None:
        memory_bandwidth = gpu.memory_bandwidth_Bps
    else:
        raise PipetteError(f"{where}: devices need 'memory_bandwidth_Bps' when 'gpu' is not a catalog GPU")
    return Cluster(name=str(data.get("name", "probed")), num_nodes=num_nodes, gpus_per_node=gpn,
                   memory_bytes=int(min(d["memory_bytes"] for d in devices)), memory_bandwidth_Bps=memory_bandwidth,
                   gemm_flops=np.array([float(d["gemm_flops"]) for d in devices]),
                   intra_node=tuple(LinkLevel(**c) for c in classes),
                   node_class=np.array(node_class, dtype=np.int64), inter_node=LinkLevel(**inter),
                   cross_rail_bandwidth_factor=factor, cross_rail_latency_s=extra, gpu=gpu, hosts=tuple(hosts))
