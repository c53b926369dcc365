"""Clusters with uneven links, built level by level as the probe measures them."""

import dataclasses

import numpy as np

from megatron_pipette.spec.hardware import Cluster, LinkLevel, preset_cluster


def dense(level: LinkLevel) -> LinkLevel:
    """A writable copy of a level (presets hold read-only broadcast views)."""
    copy = {f.name: None if getattr(level, f.name) is None else np.array(getattr(level, f.name), dtype=float)
            for f in dataclasses.fields(level)}
    return LinkLevel(**copy)


def slow_node_cluster(num_nodes: int = 4, gpus_per_node: int = 8, slow_node: int = 1, factor: float = 10.0,
                      preset: str = "dgx-a100") -> Cluster:
    """A preset cluster whose node `slow_node` has every inter-node link `factor` times slower."""
    c = preset_cluster(preset, num_nodes=num_nodes, gpus_per_node=gpus_per_node)
    return dataclasses.replace(c, name=f"{c.name}-slow{slow_node}",
                               inter_node=slowed_nodes(c.inter_node, [slow_node], factor))


def slowed_nodes(level: LinkLevel, nodes, factor: float) -> LinkLevel:
    """`level` with every link to or from `nodes` divided by `factor`, one way and two ways alike
    (slowing one alone can make two-way faster than one-way, which no link is)."""
    out = dense(level)
    touches = np.zeros(level.size, dtype=bool)
    touches[list(nodes)] = True
    mask = touches[:, None] | touches[None, :]
    for m in (out.bandwidth_Bps, out.exchange_bandwidth_Bps):
        if m is not None:
            m[mask] /= factor
    return out


def random_level(rng: np.random.Generator, base: LinkLevel, spread: float) -> LinkLevel:
    """Bandwidths in [1/spread, 1] of the base's, latencies 1-3x, two-way figures no better than one-way."""
    n = base.size
    bw = np.asarray(base.bandwidth_Bps) * rng.uniform(1 / spread, 1, (n, n))
    lat = np.asarray(base.latency_s) * rng.uniform(1, 3, (n, n))
    return LinkLevel(bandwidth_Bps=bw, latency_s=lat, exchange_bandwidth_Bps=bw * rng.uniform(0.5, 1, (n, n)),
                     exchange_latency_s=lat * rng.uniform(1, 2, (n, n)))


def random_cluster(seed: int, nodes: int = 4, gpn: int = 8, spread: float = 10.0, slow_devices: float = 0.2,
                   preset: str = "dgx-h100", cross_rail: bool = True) -> Cluster:
    """Every node its own intra-node class, random node x node links, slower devices, a cross-rail penalty."""
    rng = np.random.default_rng(seed)
    base = preset_cluster(preset, num_nodes=nodes, gpus_per_node=gpn)
    return dataclasses.replace(
        base, name=f"random-{seed}",
        intra_node=tuple(random_level(rng, base.intra_node[0], spread) for _ in range(nodes)),
        node_class=np.arange(nodes), inter_node=random_level(rng, base.inter_node, spread),
        gemm_flops=base.gemm_flops * rng.uniform(1 - slow_devices, 1, base.world_size),
        cross_rail_bandwidth_factor=float(rng.uniform(0.5, 1)) if cross_rail else 1.0,
        cross_rail_latency_s=float(rng.uniform(0, 5e-6)) if cross_rail else 0.0)


def with_slow_node(cluster: Cluster, node: int, factor: float) -> Cluster:
    """`cluster` with `node`'s inter-node links and its own intra-node links `factor` times slower."""
    slow_intra = slowed_nodes(cluster.intra_node[cluster.node_class[node]], range(cluster.gpus_per_node), factor)
    classes = cluster.node_class.copy()
    classes[node] = len(cluster.intra_node)
    return dataclasses.replace(cluster, intra_node=(*cluster.intra_node, slow_intra), node_class=classes,
                               inter_node=slowed_nodes(cluster.inter_node, [node], factor))


def cpu_like(nodes: int = 1, gpn: int = 4) -> Cluster:
    """A small random cluster with a CPU's proportions: links slow enough against compute to matter."""
    c = random_cluster(seed=3, nodes=nodes, gpn=gpn, spread=3.0)

    def slow(level: LinkLevel) -> LinkLevel:
        return dataclasses.replace(level, bandwidth_Bps=level.bandwidth_Bps * 1e-3,
                                   exchange_bandwidth_Bps=level.exchange_bandwidth_Bps * 1e-3)

    return dataclasses.replace(c, intra_node=tuple(slow(level) for level in c.intra_node),
                               inter_node=slow(c.inter_node), gemm_flops=c.gemm_flops / 2e4,
                               memory_bandwidth_Bps=c.memory_bandwidth_Bps / 1e3)
