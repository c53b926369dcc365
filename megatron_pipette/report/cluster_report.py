"""What a probed cluster looks like: a text summary and a bandwidth heatmap.

Why: before trusting a plan built on measurements, a person wants to see
the weak spots the planner will route around — the slowest links, the
devices that compute well below their peers, how each node's links compare,
and what the probe had to skip for its budget. `summarize` is pure (document
in, text out); `write_heatmap` only writes the PNG. `pipette show` calls both.
"""

from __future__ import annotations

import os

import numpy as np

from megatron_pipette.plan.placement import node_link_weakness
from megatron_pipette.report.figures import figure, load_matplotlib, write_png
from megatron_pipette.spec.cluster_file import ClusterFile
from megatron_pipette.spec.hardware import Cluster
from megatron_pipette.units import GiB

STRAGGLER_FRACTION = 0.8
"""A device is a straggler when its GEMM rate is below this fraction of the median."""
SLOWEST_LINKS = 5


def _rate(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _time(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def _who(cluster, rank: int) -> str:
    node, local = divmod(rank, cluster.gpus_per_node)
    host = cluster.hosts[node] if cluster.hosts else f"node{node}"
    return f"rank {rank} ({host}, local {local})"


def _node(cluster, k: int) -> str:
    return f"node {k} ({cluster.hosts[k]})" if cluster.hosts else f"node {k}"


def summarize(shown: ClusterFile) -> str:
    """A plain-text report of a cluster file."""
    cluster, probe = shown.cluster, shown.probe
    n, gpn, nodes = cluster.world_size, cluster.gpus_per_node, cluster.num_nodes
    kind = cluster.gpu.name if cluster.gpu else (shown.device_name or "unknown")
    lines = [f"Cluster {cluster.name}: {n} devices, {nodes} node(s) x {gpn} ({kind}), "
             f"precision {shown.precision or '?'}"]
    if probe is not None:
        known = (lambda v: "?" if v is None else v)  # noqa: E731
        lines.append(f"Probed with {known(probe.backend)} in {probe.duration_s or 0:.2f} s "
                     f"(budget {probe.budget_s or 0:g} s): {known(probe.intra_rounds_measured)} of "
                     f"{known(probe.intra_rounds)} intra-node and {known(probe.inter_rounds_measured)} of "
                     f"{known(probe.inter_rounds)} inter-node rounds")

    flops = cluster.gemm_flops
    median = float(np.median(flops))
    slow = int(np.argmin(flops))
    lines += ["", f"Compute: GEMM median {_rate(median, 'FLOP/s')}, range {_rate(float(flops.min()), 'FLOP/s')}"
                  f" .. {_rate(float(flops.max()), 'FLOP/s')}",
              f"  slowest device: {_who(cluster, slow)} at {_rate(float(flops[slow]), 'FLOP/s')}, "
              f"{flops[slow] / median:.0%} of the median"]
    stragglers = [int(i) for i in np.argsort(flops) if flops[i] < STRAGGLER_FRACTION * median]
    shown = ", ".join(f"{_who(cluster, i)} {flops[i] / median:.0%}" for i in stragglers[:SLOWEST_LINKS])
    more = f" and {len(stragglers) - SLOWEST_LINKS} more" if len(stragglers) > SLOWEST_LINKS else ""
    lines.append(f"  stragglers (below {STRAGGLER_FRACTION:.0%} of the median): {shown or 'none'}{more}")
    lines.append(f"  memory: {cluster.memory_bytes / GiB:.1f} GiB per device (smallest), bandwidth "
                 f"{_rate(cluster.memory_bandwidth_Bps, 'B/s')} (lowest)")

    lines += ["", "Inside the nodes (one-way bandwidth under load):"]
    for k, level in enumerate(cluster.intra_node):
        members = np.flatnonzero(cluster.node_class == k)
        off = ~np.eye(gpn, dtype=bool)
        bw = np.asarray(level.bandwidth_Bps)[off] if gpn > 1 else np.array([np.inf])
        who = ", ".join(str(m) for m in members[:8]) + (f" ... ({members.size} nodes)" if members.size > 8 else "")
        lines.append(f"  class {k} (nodes {who}): median {_rate(float(np.median(bw)), 'B/s')}, "
                     f"slowest {_rate(float(bw.min()), 'B/s')}")
    if nodes > 1:
        bw, lat = cluster.inter_node.bandwidth_Bps, cluster.inter_node.latency_s
        both = np.minimum(bw, bw.T)
        upper = np.triu_indices(nodes, 1)
        order = np.argsort(both[upper], kind="stable")[:SLOWEST_LINKS]
        lines += ["", f"Between nodes (rail to rail, one-way bandwidth under load; {upper[0].size} node pairs):",
                  f"  median {_rate(float(np.median(both[upper])), 'B/s')}; cross-rail pairs get "
                  f"{cluster.cross_rail_bandwidth_factor:.0%} of it"
                  + (f" and +{_time(cluster.cross_rail_latency_s)} latency" if cluster.cross_rail_latency_s else ""),
                  f"  all-to-alls between NVLink domains get {cluster.all_to_all_bandwidth_factor:.0%} of their "
                  "links' rate "
                  + (f"(measured: all-to-alls among {probe.all_to_all_nodes_per_block} nodes at once)"
                     if probe is not None and probe.all_to_all_nodes_per_block else "(assumed)")]
        lines.append("  slowest node pairs:")
        for i in order:
            a, b = int(upper[0][i]), int(upper[1][i])
            lines.append(f"    {_node(cluster, a)} <-> {_node(cluster, b)}  {_rate(float(both[a, b]), 'B/s'):>11}  "
                         f"latency {_time(float(max(lat[a, b], lat[b, a])))}")
        weakness = node_link_weakness(cluster)
        worst = np.argsort(-weakness, kind="stable")[:SLOWEST_LINKS]
        lines.append("  weakest nodes (harmonic mean of their inter-node bandwidth): " + ", ".join(
            f"{_node(cluster, int(k))} {_rate(1 / float(weakness[k]), 'B/s')}" for k in worst))
        if cluster.domain_of_node is not None:
            lines.append(f"  NVLink domains: {np.unique(cluster.domains).size} of "
                         f"{cluster.gpus_per_domain} GPUs (smallest)")
    slow_links = probe.slow_links if probe is not None else ()
    if slow_links:
        lines += ["", "Slow links found by the probe (measured far below what their nodes' rates predict):"]
        lines += [f"  - {s}" for s in slow_links]

    skipped = probe.skipped if probe is not None else ()
    lines += ["", "Skipped by the probe:" + ("" if skipped else " nothing")]
    lines += [f"  - {s}" for s in skipped]
    return "\n".join(lines)


def write_heatmap(cluster: Cluster, path: str | os.PathLike) -> None:
    """Write a PNG of the node x node bandwidth (GB/s, rail to rail) beside the intra-node matrix of
    the first node class."""
    load_matplotlib()
    from matplotlib.ticker import MaxNLocator

    inter = np.array(cluster.inter_node.bandwidth_Bps, dtype=float) / 1e9
    intra = np.array(cluster.intra_node[0].bandwidth_Bps, dtype=float) / 1e9
    np.fill_diagonal(inter, np.nan)
    np.fill_diagonal(intra, np.nan)
    fig = figure(15, 6.5)
    for k, (matrix, title, unit) in enumerate(((inter, f"between nodes ({cluster.num_nodes})", "node"),
                                                (intra, f"inside a node (class 0 of {len(cluster.intra_node)})",
                                                 "local rank"))):
        ax = fig.add_subplot(1, 2, k + 1)
        image = ax.imshow(matrix, cmap="viridis", interpolation="nearest")
        fig.colorbar(image, ax=ax, label="one-way bandwidth (GB/s)")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(f"to {unit}")
        ax.set_ylabel(f"from {unit}")
        ax.set_title(title)
    fig.suptitle(f"{cluster.name}: {cluster.num_nodes} node(s) x {cluster.gpus_per_node}")
    write_png(fig, path, "--heatmap")
