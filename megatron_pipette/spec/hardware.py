"""The hardware: a GPU catalog and clusters with a per-GPU-pair link matrix.

A `Cluster` is what the cost model sees: for every ordered pair of devices the
one-way bandwidth and latency a message attains while every device talks at
once, and every device's attainable GEMM throughput. Presets build uniform
matrices from node figures; the in-job probe measures them
(`megatron_pipette.spec.cluster_file` reads and writes that file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

import numpy as np

from megatron_pipette.errors import PipetteError

# Fraction of a datasheet dense peak that large training GEMMs attain; the
# roofline default when nothing was measured. The H100 machine measured
# 798 of 989 TFLOP/s (0.81) on an 8192^3 bf16 GEMM (shared/reference/hardware.md);
# transformer-layer GEMMs are smaller, hence a lower default.
DEFAULT_GEMM_EFFICIENCY = 0.75


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One catalog entry (data/gpus.json)."""

    name: str
    """Catalog name, e.g. "A100-80GB"."""
    memory_bytes: int
    """Device memory capacity, as the driver reports it."""
    memory_bandwidth_Bps: float
    """Datasheet HBM bandwidth, bytes/s."""
    peak_flops: dict[str, float] = field(hash=False)
    """Dense peak FLOP/s per precision ("fp32", "fp16", "bf16", "fp8")."""
    aliases: tuple[str, ...] = ()
    """Other names for it (device names as torch reports them)."""

    def peak(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise PipetteError(f"--gpu {self.name} has no {precision} peak in the catalog")
        return self.peak_flops[precision]


@cache
def gpu_catalog() -> dict[str, GPU]:
    """All catalog GPUs by every name and alias, lower-cased."""
    data = json.loads(resources.files("megatron_pipette.data").joinpath("gpus.json").read_text())
    catalog: dict[str, GPU] = {}
    for entry in data["gpus"]:
        gpu = GPU(name=entry["name"], memory_bytes=int(entry["memory_bytes"]),
                  memory_bandwidth_Bps=float(entry["memory_bandwidth_Bps"]),
                  peak_flops={k: float(v) for k, v in entry["peak_flops"].items()},
                  aliases=tuple(entry.get("aliases", ())))
        for name in (gpu.name, *gpu.aliases):
            catalog[name.lower()] = gpu
    return catalog


def lookup_gpu(name: str) -> GPU:
    """A catalog GPU by name or alias, case-insensitive."""
    gpu = gpu_catalog().get(name.lower())
    if gpu is None:
        names = sorted({g.name for g in gpu_catalog().values()})
        raise PipetteError(f"--gpu {name!r} is not in the catalog; known: {', '.join(names)}")
    return gpu


@dataclass(frozen=True, kw_only=True, eq=False)
class Cluster:
    """Devices grouped in equal nodes, with measured or preset link and compute figures.

    Device i is torchrun rank i of the probed job; node of device i is
    i // gpus_per_node. Hashed by identity (it holds arrays).
    """

    name: str
    """A label: the preset name or the probe's."""
    num_nodes: int
    gpus_per_node: int
    memory_bytes: int
    """Per-device memory capacity the planner must fit in (the smallest device's)."""
    memory_bandwidth_Bps: float
    """Per-device memory bandwidth, for memory-bound operations."""
    gemm_flops: np.ndarray
    """(N,) attainable GEMM FLOP/s per device at the training precision."""
    bandwidth_Bps: np.ndarray
    """(N, N) one-way bytes/s from device i to device j; the diagonal is unused."""
    latency_s: np.ndarray
    """(N, N) per-message start-up time (alpha), seconds."""
    exchange_bandwidth_Bps: np.ndarray | None = None
    """(N, N) bytes/s from i to j while j sends to i at the same time (1F1B's exchanges, ring
    collective steps); None: full-duplex links, as fast as one way."""
    exchange_latency_s: np.ndarray | None = None
    """(N, N) start-up time of a message inside such an exchange; None: latency_s."""
    gpu: GPU | None = None
    """The catalog entry, when the devices are a known GPU (None for CPU rehearsals)."""
    hosts: tuple[str, ...] = ()
    """Host name per node, when known."""

    def __post_init__(self) -> None:
        n = self.world_size
        if self.num_nodes <= 0:
            raise PipetteError(f"--num-nodes must be a positive integer, got {self.num_nodes}")
        if self.gpus_per_node <= 0:
            raise PipetteError(f"--gpus-per-node must be a positive integer, got {self.gpus_per_node}")
        assert self.bandwidth_Bps.shape == (n, n) and self.latency_s.shape == (n, n)
        assert self.gemm_flops.shape == (n,)
        assert self.exchange_bandwidth_Bps is None or self.exchange_bandwidth_Bps.shape == (n, n)
        assert self.exchange_latency_s is None or self.exchange_latency_s.shape == (n, n)

    @property
    def two_way_bandwidth_Bps(self) -> np.ndarray:
        """(N, N) bytes/s per direction when both directions of a pair are busy."""
        return self.bandwidth_Bps if self.exchange_bandwidth_Bps is None else self.exchange_bandwidth_Bps

    @property
    def two_way_latency_s(self) -> np.ndarray:
        """(N, N) per-message start-up time when both directions of a pair are busy."""
        return self.latency_s if self.exchange_latency_s is None else self.exchange_latency_s

    @property
    def full_duplex(self) -> bool:
        """True when exchanges cost what single messages do (no two-way figures given)."""
        return self.exchange_bandwidth_Bps is None and self.exchange_latency_s is None

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_of(self, device: int) -> int:
        return device // self.gpus_per_node

    def peak_flops(self, precision: str) -> float:
        """Datasheet peak when the GPU is known, else the best measured GEMM rate."""
        return self.gpu.peak(precision) if self.gpu else float(self.gemm_flops.max())


def uniform_links(num_nodes: int, gpus_per_node: int, intra_bw: float, intra_lat: float,
                  inter_bw: float, inter_lat: float) -> tuple[np.ndarray, np.ndarray]:
    """Bandwidth and latency matrices of identical nodes on an identical fabric."""
    node = np.arange(num_nodes * gpus_per_node) // gpus_per_node
    same = node[:, None] == node[None, :]
    return np.where(same, intra_bw, inter_bw).astype(float), np.where(same, intra_lat, inter_lat).astype(float)


@cache
def cluster_presets() -> dict[str, dict]:
    data = json.loads(resources.files("megatron_pipette.data").joinpath("clusters.json").read_text())
    return {c["name"]: c for c in data["clusters"]}


def preset_cluster(name: str, *, num_nodes: int | None = None, gpus_per_node: int | None = None,
                   gpu: str | None = None, precision: str = "bf16") -> Cluster:
    """A uniform cluster from a preset, with node count, node size or GPU overridden."""
    presets = cluster_presets()
    if name not in presets:
        raise PipetteError(f"--cluster {name!r} is neither a preset ({', '.join(presets)}) nor a file")
    p = presets[name]
    num_nodes = p["num_nodes"] if num_nodes is None else num_nodes
    gpus_per_node = p["gpus_per_node"] if gpus_per_node is None else gpus_per_node
    if num_nodes <= 0:
        raise PipetteError(f"--num-nodes must be a positive integer, got {num_nodes}")
    if gpus_per_node <= 0:
        raise PipetteError(f"--gpus-per-node must be a positive integer, got {gpus_per_node}")
    device = lookup_gpu(gpu or p["gpu"])
    bw, lat = uniform_links(num_nodes, gpus_per_node, p["intra_node_bandwidth_Bps"], p["intra_node_latency_s"],
                            p["inter_node_bandwidth_Bps"], p["inter_node_latency_s"])
    n = num_nodes * gpus_per_node
    return Cluster(name=f"{name}x{num_nodes}", num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                   memory_bytes=device.memory_bytes, memory_bandwidth_Bps=device.memory_bandwidth_Bps,
                   gemm_flops=np.full(n, device.peak(precision) * DEFAULT_GEMM_EFFICIENCY),
                   bandwidth_Bps=bw, latency_s=lat, gpu=device)
