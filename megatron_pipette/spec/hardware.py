"""The hardware: a GPU catalog, and clusters described level by level.

A `Cluster` is what the cost model sees, in two levels so that it scales with
nodes rather than GPUs: the links inside a node as a gpus-per-node matrix
(`intra_node`, one per class of nodes that measured alike), the links between
nodes as a node x node matrix (`inter_node`: the rate one GPU gets from local
rank k of one node to local rank k of another while every rail of both nodes
is busy, the load a pipeline-stage boundary puts on the fabric), a cross-rail
correction for inter-node pairs of different local ranks, and per-GPU compute
as a vector. No GPU x GPU array exists anywhere: memory is O(nodes^2 + GPUs).
Presets build it from node figures; the in-job probe measures it
(`megatron_pipette.spec.cluster_file` reads and writes that file).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from importlib import resources

import numpy as np

from megatron_pipette.errors import PipetteError

DEFAULT_GEMM_EFFICIENCY = 0.75
"""Fraction of the dense datasheet peak an 8192^3 GEMM (the probe's GEMM: cluster.gemm_flops)
attains, for a GPU whose catalog entry has no measured figure (large_gemm_efficiency). Assumed,
not measured: H100 and H200 measure 0.79-0.80 in bf16; the shapes of a transformer layer then run
at a fraction of that rate (cost.gemm.gemm_curve)."""
MAX_NODES = 16384
"""Nodes a cluster may have: a non-uniform node x node level is held as dense matrices (2 GiB each
at the limit); uniform presets hold broadcast views, but their per-device arrays grow with nodes."""
MAX_GPUS_PER_NODE = 1024
"""GPUs of one node (or NVLink domain described as one): above the largest built (NVL576)."""


def check_cluster_shape(num_nodes: object, gpus_per_node: object, names: tuple[str, str]) -> None:
    """Raise PipetteError naming the flag (or file field) unless the node count and node size are
    positive integers up to MAX_NODES and MAX_GPUS_PER_NODE: every per-device array the
    planner builds is sized by them."""
    for name, value, limit in zip(names, (num_nodes, gpus_per_node), (MAX_NODES, MAX_GPUS_PER_NODE)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise PipetteError(f"{name} must be a positive integer, got {value!r}")
        if value > limit:
            raise PipetteError(f"{name} must be at most {limit}, got {value}")


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One catalog entry (data/gpus.json)."""

    name: str
    """Catalog name, e.g. "A100-80GB"."""
    memory_bytes: int
    """Device memory capacity, as the driver reports it."""
    memory_bandwidth_Bps: float
    """Datasheet HBM bandwidth, bytes/s."""
    copy_bandwidth_Bps: float | None = None
    """Measured device-to-device copy rate, bytes read and written per second: what the probe
    measures, and what memory-bound kernels attain; None where not measured (the datasheet's)."""
    peak_flops: dict[str, float] = field(hash=False)
    """Dense peak FLOP/s per precision ("fp32", "fp16", "bf16", "fp8")."""
    compute_capability: tuple[int, int] | None = None
    """CUDA compute capability (major, minor), as torch.cuda.get_device_capability() reports it."""
    aliases: tuple[str, ...] = ()
    """Other names for it (device names as torch reports them)."""
    large_gemm_efficiency: dict[str, float] = field(default_factory=dict, hash=False)
    """Measured rate of an 8192^3 GEMM over the dense peak, per precision (where measured)."""
    step_gemm_fraction: float = 1.0
    """The share of its GEMM tables' rate a training step's GEMMs get, fitted on published runs
    (data/gpus.json says on which): time real steps take beyond their kernels' isolated prices,
    not attributed to a cause. Not the power-limited clock, which the tables already hold
    (docs/validation.md, "The planner's prices on one GPU"); 1 where nothing was fitted."""

    @property
    def attained_memory_bandwidth_Bps(self) -> float:
        """The HBM rate a memory-bound kernel attains: the measured copy rate, else the datasheet's."""
        return self.copy_bandwidth_Bps or self.memory_bandwidth_Bps

    def large_gemm_rate(self, precision: str) -> float:
        """The rate of an 8192^3 GEMM in this dtype (what the probe measures): the measured fraction
        of the dense peak, DEFAULT_GEMM_EFFICIENCY where none was measured."""
        return self.peak(precision) * self.large_gemm_efficiency.get(precision, DEFAULT_GEMM_EFFICIENCY)

    @property
    def fp8_gemm_any_layout(self) -> bool:
        """Its FP8 GEMMs take either operand layout, so Transformer Engine keeps no transposed copy of
        a per-tensor FP8 tensor (TE 2.20 utils.is_non_tn_fp8_gemm_supported: compute capability
        10.0 to 11.x, or 13.0 on; Float8TensorStorage.update_usage drops the transpose there). False
        where unknown: Hopper's TN-only GEMMs, the larger footprint."""
        cc = self.compute_capability
        return cc is not None and ((10, 0) <= cc < (12, 0) or cc >= (13, 0))

    def peak(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise PipetteError(f"--gpu {self.name} has no {precision} peak in the catalog")
        return self.peak_flops[precision]


# Module-level memo: package data, read once (a pure function of no argument).
@cache
def gpu_catalog() -> dict[str, GPU]:
    """All catalog GPUs by every name and alias, lower-cased."""
    data = json.loads(resources.files("megatron_pipette.data").joinpath("gpus.json").read_text())
    catalog: dict[str, GPU] = {}
    for entry in data["gpus"]:
        gpu = GPU(name=entry["name"], memory_bytes=int(entry["memory_bytes"]),
                  memory_bandwidth_Bps=float(entry["memory_bandwidth_Bps"]),
                  copy_bandwidth_Bps=float(entry["copy_bandwidth_Bps"]) if "copy_bandwidth_Bps" in entry else None,
                  peak_flops={k: float(v) for k, v in entry["peak_flops"].items()},
                  compute_capability=tuple(entry["compute_capability"]) if "compute_capability" in entry else None,
                  aliases=tuple(entry.get("aliases", ())),
                  large_gemm_efficiency={k: float(v) for k, v in entry.get("large_gemm_efficiency", {}).items()},
                  step_gemm_fraction=float(entry.get("step_gemm_fraction", 1.0)))
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
class LinkLevel:
    """The links among the endpoints of one level (the GPUs of a node, or the nodes of a cluster).

    Matrices are (n, n), row = sender; the diagonal is unused. A uniform level may hold
    read-only broadcast views of one value (np.broadcast_to), which cost no memory at any n.
    """

    bandwidth_Bps: np.ndarray
    """One-way bytes/s from i to j while every endpoint talks at once (nothing comes back)."""
    latency_s: np.ndarray
    """Per-message start-up time (alpha) from i to j, seconds."""
    exchange_bandwidth_Bps: np.ndarray | None = None
    """Bytes/s from i to j while j sends to i at the same time (1F1B's exchanges, ring
    collective steps); None: full-duplex links, as fast as one way."""
    exchange_latency_s: np.ndarray | None = None
    """Start-up time of a message inside such an exchange; None: latency_s."""
    batched_exchange_bandwidth_Bps: np.ndarray | None = None
    """Bytes/s from i to j inside an exchange posted as megatron-core's 1F1B posts it (one batch,
    the send before the receive on both sides): on gloo a send posted first can hold back the
    receive behind it, which the exchange figures above, timed with the two posted in opposite
    orders, do not show; None: the exchange figures."""
    batched_exchange_latency_s: np.ndarray | None = None
    """Start-up time of a message inside such a batched exchange; None: the exchange figures'."""

    def __post_init__(self) -> None:
        n = self.bandwidth_Bps.shape[0]
        for m in (self.bandwidth_Bps, self.latency_s, self.exchange_bandwidth_Bps, self.exchange_latency_s,
                  self.batched_exchange_bandwidth_Bps, self.batched_exchange_latency_s):
            assert m is None or m.shape == (n, n), "every matrix of a level has the same square shape"

    @property
    def size(self) -> int:
        return self.bandwidth_Bps.shape[0]

    @property
    def full_duplex(self) -> bool:
        """True when exchanges cost what single messages do (no two-way figures given)."""
        return all(m is None for m in (self.exchange_bandwidth_Bps, self.exchange_latency_s,
                                       self.batched_exchange_bandwidth_Bps, self.batched_exchange_latency_s))

    def figures(self, two_way: bool, batched: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(latency_s, bandwidth_Bps) of single messages, or of messages inside an exchange
        (`batched`: one posted as 1F1B posts it); a figure not given falls back to the simpler kind."""
        if not two_way:
            return self.latency_s, self.bandwidth_Bps
        lat = self.latency_s if self.exchange_latency_s is None else self.exchange_latency_s
        bw = self.bandwidth_Bps if self.exchange_bandwidth_Bps is None else self.exchange_bandwidth_Bps
        if not batched:
            return lat, bw
        return (lat if self.batched_exchange_latency_s is None else self.batched_exchange_latency_s,
                bw if self.batched_exchange_bandwidth_Bps is None else self.batched_exchange_bandwidth_Bps)


def uniform_level(n: int, bandwidth_Bps: float, latency_s: float) -> LinkLevel:
    """A level whose every link is alike (presets): broadcast views, no n x n memory."""
    return LinkLevel(bandwidth_Bps=np.broadcast_to(np.float64(bandwidth_Bps), (n, n)),
                     latency_s=np.broadcast_to(np.float64(latency_s), (n, n)))


@dataclass(frozen=True, kw_only=True, eq=False)
class Cluster:
    """Equal nodes of GPUs, with measured or preset link and compute figures.

    Device d is torchrun rank d of the probed job: node d // gpus_per_node, local rank
    d % gpus_per_node. Hashed by identity (it holds arrays).
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
    intra_node: tuple[LinkLevel, ...]
    """Links inside a node, one gpus_per_node level per class of nodes that measured alike."""
    node_class: np.ndarray
    """(num_nodes,) index into intra_node of each node."""
    inter_node: LinkLevel
    """num_nodes level: the links from local rank k of node a to local rank k of node b under
    rail-to-rail load (every local rank of both nodes exchanging at once)."""
    cross_rail_bandwidth_factor: float = 1.0
    """Inter-node pairs of different local ranks (in different NVLink domains) get this fraction
    of the rail-to-rail rate (their traffic crosses the fabric's spine, or a PXN hop inside the node)."""
    cross_rail_latency_s: float = 0.0
    """Extra start-up time of such cross-rail messages, seconds."""
    all_to_all_bandwidth_factor: float = 1.0
    """An all-to-all's traffic between NVLink domains attains this fraction of what its links'
    figures give alone: many-to-many flows meet at receivers and in the fabric's spine, where the
    rail-to-rail rounds load each link one node pair at a time. Measured by the probe (all-to-alls
    among blocks of nodes); 1.0 in the presets, where it is assumed."""
    domain_of_node: np.ndarray | None = None
    """(num_nodes,) NVLink domain of each node (GB200 NVL72: 18 hosts of 4 GPUs share one);
    None: every node is its own domain. Tensor-parallel groups stay inside a domain."""
    gpu: GPU | None = None
    """The catalog entry, when the devices are a known GPU (None for CPU rehearsals)."""
    nvls: bool = False
    """NCCL's NVLink SHARP is on (NVSwitch presets of Hopper and later): its buffers take device
    memory in every communicator with two or more ranks in one NVLink domain. False where
    NCCL_NVLS_ENABLE=0, and for cluster files (the probe does not detect it)."""
    hosts: tuple[str, ...] = ()
    """Host name per node, when known."""
    host_link_Bps: float | None = None
    """Bytes/s one device copies one way to or from its host's memory while every device of the node
    copies (cost.offload: --cpu-offloading-num-layers); None where not known (cluster files)."""

    def __post_init__(self) -> None:
        check_cluster_shape(self.num_nodes, self.gpus_per_node, ("--num-nodes", "--gpus-per-node"))
        assert self.gemm_flops.shape == (self.world_size,)
        assert all(level.size == self.gpus_per_node for level in self.intra_node) and self.intra_node
        assert self.node_class.shape == (self.num_nodes,) and self.node_class.max() < len(self.intra_node)
        assert self.inter_node.size == self.num_nodes
        assert self.domain_of_node is None or self.domain_of_node.shape == (self.num_nodes,)

    @property
    def step_gemm_fraction(self) -> float:
        """GPU.step_gemm_fraction (1 without a catalog GPU): a correction of the roofline's prices of
        kernels timed alone, which measured work (a layer profile) does not take (cost.compute)."""
        return 1.0 if self.gpu is None else self.gpu.step_gemm_fraction

    @property
    def step_gemm_flops(self) -> np.ndarray:
        """(N,) the GEMM rate each device gets in a training step (step_gemm_fraction of gemm_flops):
        the rate at which the cost model prices every stage's effective FLOPs."""
        return self.gemm_flops * self.step_gemm_fraction

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def full_duplex(self) -> bool:
        """True when no level gives two-way figures: exchanges cost what single messages do."""
        return self.inter_node.full_duplex and all(level.full_duplex for level in self.intra_node)

    @cached_property
    def _intra(self) -> dict[tuple[bool, bool], tuple[np.ndarray, np.ndarray]]:
        """(classes, g, g) latency and bandwidth stacks per (two_way, batched)."""
        return {kind: tuple(np.stack([level.figures(*kind)[k] for level in self.intra_node]) for k in (0, 1))
                for kind in ((False, False), (True, False), (True, True))}

    def link(self, src: np.ndarray, dst: np.ndarray, *, two_way: bool = False,
             batched: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(latency_s, bandwidth_Bps) of the links src -> dst (device ids, arrays of one shape), alone
        or inside an exchange (`two_way`; `batched`: as 1F1B posts it). Vectorised: memory is that of
        the index arrays; each level is looked up only for the pairs on it (a group's links mostly
        lie on one)."""
        shape, g = np.shape(src), self.gpus_per_node
        src, dst = np.ravel(src), np.ravel(dst)
        node_s, node_d = src // g, dst // g                      # not np.divmod: ten times slower
        local_s, local_d = src - node_s * g, dst - node_d * g
        same_node = node_s == node_d
        lat, bw = np.empty(same_node.size), np.empty(same_node.size)
        inside, across = np.flatnonzero(same_node), np.flatnonzero(~same_node)
        if inside.size:
            intra_lat, intra_bw = self._intra[two_way, two_way and batched]
            at = (self.node_class[node_s[inside]], local_s[inside], local_d[inside])
            lat[inside], bw[inside] = intra_lat[at], intra_bw[at]
        if across.size:
            a, b = node_s[across], node_d[across]
            rail = local_s[across] == local_d[across]
            if self.domain_of_node is not None:                                 # NVSwitch has no rails
                rail |= self.domain_of_node[a] == self.domain_of_node[b]
            inter_lat, inter_bw = self.inter_node.figures(two_way, batched)
            lat[across] = inter_lat[a, b] + np.where(rail, 0.0, self.cross_rail_latency_s)
            bw[across] = inter_bw[a, b] * np.where(rail, 1.0, self.cross_rail_bandwidth_factor)
        return lat.reshape(shape), bw.reshape(shape)

    def all_to_all_links(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(latency_s, near, far) of the messages src -> dst inside an all-to-all (every message of
        it runs beside its reverse): the inverse bandwidth, s/B, of each message inside its NVLink
        domain (near) and beyond it (far, at all_to_all_bandwidth_factor of the link's rate), zero
        in the other."""
        lat, bw = self.link(src, dst, two_way=True)
        domain = self.domains
        same = domain[np.asarray(src) // self.gpus_per_node] == domain[np.asarray(dst) // self.gpus_per_node]
        return lat, np.where(same, 1.0 / bw, 0.0), np.where(same, 0.0, 1.0 / (bw * self.all_to_all_bandwidth_factor))

    def all_to_all_sums(self, ranks: np.ndarray, peers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(alpha, near, far), each (len(ranks),), of each rank's all-to-all with its row of `peers`
        (-1: none): the largest start-up of its messages and their inverse bandwidths
        (all_to_all_links) summed inside and beyond its NVLink domain."""
        has = peers >= 0
        lat, near, far = (np.zeros(peers.shape) for _ in range(3))
        lat[has], near[has], far[has] = self.all_to_all_links(np.broadcast_to(np.asarray(ranks)[:, None],
                                                                              peers.shape)[has], peers[has])
        return lat.max(axis=1), near.sum(axis=1), far.sum(axis=1)

    @property
    def domains(self) -> np.ndarray:
        """(num_nodes,) NVLink domain of each node."""
        return np.arange(self.num_nodes) if self.domain_of_node is None else self.domain_of_node

    @property
    def gpus_per_domain(self) -> int:
        """GPUs of the smallest NVLink domain: the widest tensor-parallel group that stays inside one."""
        return int(np.bincount(self.domains).min()) * self.gpus_per_node


def make_cluster(*, name: str, num_nodes: int, gpus_per_node: int, gpu: GPU | None, memory_bytes: int,
                 memory_bandwidth_Bps: float, gemm_flops: float | np.ndarray, intra_node: LinkLevel
                 | Sequence[LinkLevel], inter_node: LinkLevel, node_class: np.ndarray | None = None,
                 **rest) -> Cluster:
    """A Cluster with the common defaults filled in: one class of nodes, one GEMM rate."""
    levels = (intra_node,) if isinstance(intra_node, LinkLevel) else tuple(intra_node)
    n = num_nodes * gpus_per_node
    flops = np.broadcast_to(np.asarray(gemm_flops, dtype=float), (n,)).copy()
    classes = np.zeros(num_nodes, dtype=np.int64) if node_class is None else np.asarray(node_class)
    return Cluster(name=name, num_nodes=num_nodes, gpus_per_node=gpus_per_node, gpu=gpu,
                   memory_bytes=memory_bytes, memory_bandwidth_Bps=memory_bandwidth_Bps, gemm_flops=flops,
                   intra_node=levels, node_class=classes, inter_node=inter_node, **rest)


# Module-level memo: package data, read once (a pure function of no argument).
@cache
def cluster_presets() -> dict[str, dict]:
    data = json.loads(resources.files("megatron_pipette.data").joinpath("clusters.json").read_text())
    return {c["name"]: c for c in data["clusters"]}


def nvls_disabled(env: Mapping[str, str]) -> bool:
    """NCCL_NVLS_ENABLE=0 in the job's environment (NVIDIA's Megatron-Bridge recipes set it): NCCL
    allocates no NVLink SHARP buffers (Cluster.nvls)."""
    return env.get("NCCL_NVLS_ENABLE", "").strip() == "0"


def preset_domains(num_nodes: int, nodes_per_domain: int) -> np.ndarray:
    """(num_nodes,) NVLink domain of each node of a preset job: the fewest domains that hold it, each
    given an equal share of its consecutive nodes (the first ones more by one where they do not
    divide). Why: a job packed domain by domain (GB200 NVL72: 18, 18, 18 and 10 trays for 64) cuts
    Megatron's power-of-two groups of consecutive ranks at the racks' edges, and NVIDIA's published
    NVL72 runs did not run so: every GB200/GB300 perf recipe runs HybridEP with
    NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN equal to its expert-parallel size (64 on 256 GPUs) and
    NVLINK_DOMAIN_SIZE 72, i.e. each expert-parallel group of 64 consecutive ranks inside one rack:
    16 trays in each of 4 racks. An assumed allocation; a cluster file gives the measured one."""
    racks = -(-num_nodes // nodes_per_domain)
    return np.arange(num_nodes) * racks // num_nodes


def preset_cluster(name: str, *, num_nodes: int | None = None, gpus_per_node: int | None = None,
                   gpu: str | None = None, precision: str = "bf16") -> Cluster:
    """A uniform cluster from a preset, with node count, node size or GPU overridden."""
    presets = cluster_presets()
    if name not in presets:
        raise PipetteError(f"--cluster {name!r} is neither a preset ({', '.join(presets)}) nor a file")
    p = presets[name]
    num_nodes = p["num_nodes"] if num_nodes is None else num_nodes
    gpus_per_node = p["gpus_per_node"] if gpus_per_node is None else gpus_per_node
    check_cluster_shape(num_nodes, gpus_per_node, ("--num-nodes", "--gpus-per-node"))
    device = lookup_gpu(p["gpu"] if gpu is None else gpu)
    per_domain = p.get("nodes_per_domain", 1)
    inter, domains = uniform_level(num_nodes, p["inter_node_bandwidth_Bps"], p["inter_node_latency_s"]), None
    if per_domain > 1 and num_nodes > 1:
        domains = preset_domains(num_nodes, per_domain)
        same = domains[:, None] == domains[None, :]
        inter = LinkLevel(bandwidth_Bps=np.where(same, p["domain_bandwidth_Bps"], p["inter_node_bandwidth_Bps"]),
                          latency_s=np.where(same, p["domain_latency_s"], p["inter_node_latency_s"]))
    return make_cluster(
        name=f"{name}x{num_nodes}", num_nodes=num_nodes, gpus_per_node=gpus_per_node, gpu=device,
        memory_bytes=device.memory_bytes, memory_bandwidth_Bps=device.attained_memory_bandwidth_Bps,
        gemm_flops=device.large_gemm_rate(precision),
        intra_node=uniform_level(gpus_per_node, p["intra_node_bandwidth_Bps"], p["intra_node_latency_s"]),
        inter_node=inter, domain_of_node=domains, nvls=p.get("nvls", False),
        host_link_Bps=p.get("host_link_bandwidth_Bps"))
