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

from megatron_pipette.files import atomic_path
from megatron_pipette.spec.cluster_file import cluster_from_json

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


def summarize(cluster_doc: dict, where: str = "cluster file") -> str:
    """A plain-text report of a cluster document; raises PipetteError when it is not one."""
    cluster = cluster_from_json(cluster_doc, where=where)
    devices = sorted(cluster_doc["devices"], key=lambda d: d["rank"])
    n, gpn = cluster.world_size, cluster.gpus_per_node
    probe = cluster_doc.get("probe") or {}
    kind = cluster.gpu.name if cluster.gpu else devices[0].get("device_name", "unknown")
    lines = [f"Cluster {cluster.name}: {n} devices, {cluster.num_nodes} node(s) x {gpn} ({kind}), "
             f"precision {cluster_doc.get('precision', '?')}"]
    if probe:
        lines.append(f"Probed with {probe.get('backend', '?')} in {probe.get('duration_s', 0):.2f} s "
                     f"(budget {probe.get('budget_s', 0):g} s), {probe.get('rounds_measured', '?')} of "
                     f"{probe.get('rounds', '?')} tournament rounds")

    flops = cluster.gemm_flops
    median = float(np.median(flops))
    slow = int(np.argmin(flops))

    def who(rank: int) -> str:
        return f"rank {rank} ({devices[rank]['host']}, local {devices[rank]['local_rank']})"

    lines += ["", f"Compute: GEMM median {_rate(median, 'FLOP/s')}, range {_rate(float(flops.min()), 'FLOP/s')}"
                  f" .. {_rate(float(flops.max()), 'FLOP/s')}",
              f"  slowest device: {who(slow)} at {_rate(float(flops[slow]), 'FLOP/s')}, "
              f"{flops[slow] / median:.0%} of the median"]
    stragglers = [i for i in np.argsort(flops) if flops[i] < STRAGGLER_FRACTION * median]
    lines.append(f"  stragglers (below {STRAGGLER_FRACTION:.0%} of the median): "
                 + (", ".join(f"{who(int(i))} {flops[i] / median:.0%}" for i in stragglers) or "none"))
    mem_bw = [d.get("memory_bandwidth_Bps") for d in devices]
    if all(isinstance(b, (int, float)) for b in mem_bw):
        low = int(np.argmin(mem_bw))
        lines.append(f"  memory bandwidth: median {_rate(float(np.median(mem_bw)), 'B/s')}, "
                     f"lowest {_rate(float(mem_bw[low]), 'B/s')} on rank {low}")

    if n > 1:
        bw, lat = cluster.bandwidth_Bps, cluster.latency_s
        node = np.arange(n) // gpn
        pairs = [(min(bw[i, j], bw[j, i]), i, j) for i in range(n) for j in range(i + 1, n)]
        pairs.sort()
        lines += ["", f"Slowest links (of {len(pairs)} pairs, one-way bandwidth under load):"]
        for b, i, j in pairs[:SLOWEST_LINKS]:
            link = "intra" if node[i] == node[j] else "inter"
            lines.append(f"  {i:>4} <-> {j:<4} {link}-node  {_rate(float(b), 'B/s'):>11}  "
                         f"latency {_time(float(max(lat[i, j], lat[j, i])))}")
        lines += ["", "Per node (mean one-way bandwidth):"]
        off = ~np.eye(n, dtype=bool)
        for k in range(cluster.num_nodes):
            mine = node == k
            intra = bw[np.outer(mine, mine) & off]
            inter = bw[np.outer(mine, ~mine)]
            host = cluster.hosts[k] if cluster.hosts else f"node{k}"
            lines.append(f"  node {k} ({host}): intra {_rate(float(intra.mean()), 'B/s') if intra.size else '-'}"
                         f", inter {_rate(float(inter.mean()), 'B/s') if inter.size else '-'}")

    colls = cluster_doc.get("collectives") or []
    if colls:
        lines += ["", "All-reduce on TP groups (bus bandwidth, nccl-tests convention):"]
        for size in sorted({len(c["ranks"]) for c in colls}):
            group = [c for c in colls if len(c["ranks"]) == size]
            worst = min(group, key=lambda c: c["busbw_Bps"])
            lines.append(f"  TP {size}: median {_rate(float(np.median([c['busbw_Bps'] for c in group])), 'B/s')}"
                         f" over {len(group)} group(s) of {group[0]['bytes'] / 2**20:.3g} MiB; slowest "
                         f"{worst['ranks']} {_rate(float(worst['busbw_Bps']), 'B/s')}")

    skipped = probe.get("skipped") or []
    lines += ["", "Skipped by the probe:" + ("" if skipped else " nothing")]
    lines += [f"  - {s.get('reason', s.get('what', s))}" for s in skipped]
    return "\n".join(lines)


def write_heatmap(cluster_doc: dict, path: str | os.PathLike, where: str = "cluster file") -> None:
    """Write a PNG of the one-way bandwidth matrix (GB/s), node boundaries drawn as lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cluster = cluster_from_json(cluster_doc, where=where)
    n, gpn = cluster.world_size, cluster.gpus_per_node
    bw = cluster.bandwidth_Bps.copy() / 1e9
    np.fill_diagonal(bw, np.nan)
    size = min(4 + n * 0.25, 14)
    fig = Figure(figsize=(size + 1.5, size), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(bw, cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="one-way bandwidth (GB/s)")
    if cluster.num_nodes > 1:
        for k in range(1, cluster.num_nodes):
            ax.axhline(k * gpn - 0.5, color="white", linewidth=1.5)
            ax.axvline(k * gpn - 0.5, color="white", linewidth=1.5)
    if n <= 32:
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
    else:
        centers = [k * gpn + (gpn - 1) / 2 for k in range(cluster.num_nodes)]
        step = max(1, cluster.num_nodes // 16)
        ax.set_xticks(centers[::step], [f"n{k}" for k in range(0, cluster.num_nodes, step)])
        ax.set_yticks(centers[::step], [f"n{k}" for k in range(0, cluster.num_nodes, step)])
    ax.set_xlabel("to rank")
    ax.set_ylabel("from rank")
    ax.set_title(f"{cluster.name}: {cluster.num_nodes} node(s) x {gpn}")
    with atomic_path(path, "--heatmap") as tmp:
        fig.savefig(tmp, format="png")
