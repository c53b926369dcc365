"""From measured times to link figures: alpha-beta fits, the per-node fill, slow links, classes.

Why: the budget measures every link inside a node but, at scale, only some node pairs; the
rest is filled from a per-node model fitted on what was measured (a node's sending and
receiving rate, the fabric's median): link(a, b) ~ min(out_a, in_b). One slow node shows in
every round it ran, so a few rounds find it; a measured link far below what its two nodes
predict is reported as a slow link. All array work is vectorised over nodes (no loop over
pairs), so a 2048-node document builds in well under a second. Pure: numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_pipette.errors import PipetteError
from megatron_pipette.probe.engine import METRICS, Measurements, PhaseResult

WELL_CONDITIONED = 0.5
"""Fit beta from the size difference only when t(L) - t(S) >= this fraction of t(L)."""
SLOW_LINK_FRACTION = 0.5
"""A measured node pair below this fraction of what its nodes' fitted rates predict is a slow link."""
SLOW_NODE_FRACTION = 0.75
"""A node whose fitted rate is below this fraction of the fabric's median is a slow node."""
CLASS_TOLERANCE = 1.25
"""Nodes whose intra-node bandwidths all lie within this factor of a class's first node share it."""
DOMAIN_FRACTION = 0.5
"""Node pairs whose rail bandwidth reaches this fraction of the intra-node median share an NVLink domain."""


def medium_bytes(small_bytes: int, large_bytes: int) -> int:
    """The medium exchange size: the power of two nearest the geometric mean of the two sizes
    (128 KiB for 4 KiB and 4 MiB, 512 KiB for 4 KiB and 64 MiB)."""
    return 2 ** round(math.log2(math.sqrt(small_bytes * large_bytes)))


def alpha_beta(small_s: np.ndarray, large_s: np.ndarray, small_bytes: int,
               large_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Bandwidth (B/s) and latency (s) per direction from the two acknowledged one-way timings.

    t(S) = 2 alpha + S/beta (the message, then a one-byte reply): beta from the difference of
    the two sizes, alpha from the small one. The difference is only trusted when the small
    message takes at most half the large one's time (WELL_CONDITIONED); otherwise a noisy
    small timing could inflate beta without bound, and beta falls back to L/t(L), a lower
    bound that is close when the large message dominates. Entries without a large timing get
    NaN bandwidth (filled later) and NaN latency (`latency_from_small` after the fill).
    """
    dt = large_s - small_s
    with np.errstate(invalid="ignore", divide="ignore"):
        bw = np.where(dt >= WELL_CONDITIONED * large_s, (large_bytes - small_bytes) / dt, large_bytes / large_s)
    bw[~np.isfinite(bw) | (bw <= 0)] = np.nan
    return bw, latency_from_small(small_s, bw, small_bytes)


def latency_from_small(small_s: np.ndarray, bw: np.ndarray, small_bytes: int) -> np.ndarray:
    """alpha = (t(S) - S/beta) / 2, the message's and the reply's start-up each, floored at 0
    (NaN where either is unknown)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        lat = (small_s - small_bytes / bw) / 2
    return np.where(np.isnan(lat), np.nan, np.maximum(lat, 0.0))


def two_way_alpha_beta(medium_s: np.ndarray, large_s: np.ndarray, medium: int, large_bytes: int,
                       bw: np.ndarray, lat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-direction bandwidth and latency while the reverse direction is busy, from each pair's
    exchange times at two sizes: t_x(S) = alpha_x + S/beta_x. beta_x comes from the difference
    (else L/t_x(L)) and is never above the one-way rate (an exchange ends with its slower
    direction, so the faster one is known only to be at least this fast); alpha_x, from the
    medium size, never below the one-way latency: what a link that is not full duplex loses on
    a medium message (acknowledgements queued behind the other direction's data) shows there."""
    bw_x, _ = alpha_beta(medium_s, large_s, medium, large_bytes)
    bw_x = np.fmin(bw_x, bw)
    with np.errstate(invalid="ignore", divide="ignore"):
        lat_x = np.fmax(medium_s - medium / bw_x, lat)
    return bw_x, np.where(np.isnan(bw_x), np.nan, lat_x)


def pair_min(m: np.ndarray) -> np.ndarray:
    """Exchange time per pair from both partners' timings (the later starter waited less, so the
    smaller is the better estimate); over the last two axes, symmetric, NaN ignored on one side."""
    return np.fmin(m, np.swapaxes(m, -1, -2))


@dataclass(frozen=True)
class Figures:
    """The four link figures of one level, (..., n, n); NaN where not known."""

    bandwidth_Bps: np.ndarray
    latency_s: np.ndarray
    exchange_bandwidth_Bps: np.ndarray
    exchange_latency_s: np.ndarray


def figures(times: dict[str, np.ndarray], small_bytes: int, large_bytes: int) -> Figures:
    """Fit the figures from sender-side times (METRICS -> (..., n, n), row = sender)."""
    bw, lat = alpha_beta(times["small_s"], times["large_s"], small_bytes, large_bytes)
    xbw, xlat = two_way_alpha_beta(pair_min(times["exchange_medium_s"]), pair_min(times["exchange_large_s"]),
                                   medium_bytes(small_bytes, large_bytes), large_bytes, bw, lat)
    return Figures(bw, lat, xbw, xlat)


def _ran(phase: PhaseResult) -> list:
    return list(zip(phase.rounds, phase.times))


def _median_or(values: np.ndarray, axis: int, default: float) -> np.ndarray:
    """Median of the non-NaN entries along `axis`, `default` where there are none. One sort of the
    whole array (NaN sorts last) instead of numpy's per-row nanmedian, which loops in Python."""
    ordered = np.sort(np.moveaxis(values, axis, -1), axis=-1)
    if ordered.shape[-1] == 0:
        return np.full(ordered.shape[:-1], default)
    count = np.sum(~np.isnan(ordered), axis=-1)
    middle = [np.take_along_axis(ordered, np.minimum(k, ordered.shape[-1] - 1)[..., None], axis=-1)[..., 0]
              for k in (np.maximum(count - 1, 0) // 2, count // 2)]
    return np.where(count > 0, (middle[0] + middle[1]) / 2, default)


# Inside the nodes.

def intra_times(m: Measurements) -> dict[str, np.ndarray]:
    """METRICS -> (nodes, g, g) sender-side times inside each node (NaN: not measured)."""
    g, nodes = m.gpus_per_node, m.num_nodes
    out = {k: np.full((nodes, g, g), np.nan) for k in METRICS}
    rank = np.arange(m.world_size)
    node, local = np.divmod(rank, g)
    for rnd, times in _ran(m.intra):
        other = rnd.partner[local]
        has = other >= 0
        for i, key in enumerate(METRICS):
            out[key][node[has], local[has], other[has]] = times[has, i]
    return out


def _fill_per_node(values: np.ndarray) -> np.ndarray:
    """NaN off-diagonal entries of each node's matrix: that node's median, else every node's."""
    g = values.shape[-1]
    off = ~np.eye(g, dtype=bool)
    flat = values[:, off]
    if np.isnan(flat).all():
        raise PipetteError("probe: no link inside a node was measured within the budget; raise --budget-s")
    per_node = _median_or(flat, -1, float(np.nanmedian(flat)))
    flat = np.where(np.isnan(flat), per_node[:, None], flat)
    out = values.copy()
    out[:, off] = flat
    return out


def intra_levels(m: Measurements, small_bytes: int, large_bytes: int) -> tuple[list[Figures], np.ndarray]:
    """(one Figures per class of nodes that measured alike, each node's class)."""
    f = figures(intra_times(m), small_bytes, large_bytes)
    bw = _fill_per_node(f.bandwidth_Bps)
    lat = _fill_per_node(latency_from_small(intra_times(m)["small_s"], bw, small_bytes))
    xbw = np.fmin(_fill_per_node(f.exchange_bandwidth_Bps), bw)
    xlat = np.fmax(_fill_per_node(f.exchange_latency_s), lat)
    g = m.gpus_per_node
    off = ~np.eye(g, dtype=bool)
    seeds: list[int] = []
    node_class = np.empty(m.num_nodes, dtype=np.int64)
    for node in range(m.num_nodes):
        if seeds:
            ratio = np.abs(np.log(bw[node][off][None, :] / bw[seeds][:, off]))
            alike = np.flatnonzero(ratio.max(axis=1) <= math.log(CLASS_TOLERANCE))
            if alike.size:
                node_class[node] = alike[0]
                continue
        seeds.append(node)
        node_class[node] = len(seeds) - 1
    classes = []
    for k in range(len(seeds)):
        members = node_class == k
        classes.append(Figures(*(np.median(a[members], axis=0) for a in (bw, lat, xbw, xlat))))
    return classes, node_class


# Between the nodes.

@dataclass(frozen=True)
class InterFit:
    """The node x node level, filled, and what the fit found."""

    figures: Figures
    measured: np.ndarray
    """(nodes, nodes) bool: the pair's bandwidth was measured (both sizes)."""
    out_rate_Bps: np.ndarray
    """(nodes,) fitted sending rate of each node (median of its measured links)."""
    in_rate_Bps: np.ndarray
    """(nodes,) fitted receiving rate."""
    fabric_Bps: float
    """Median of every measured node pair."""
    slow_links: list[dict]
    slow_nodes: list[dict]
    cross_rail_bandwidth_factor: float
    cross_rail_latency_s: float


def inter_times(m: Measurements, kind: str) -> dict[str, np.ndarray]:
    """METRICS -> (nodes, nodes) sender-node times of the rounds of `kind` (slowest rail; NaN: not run)."""
    nodes = m.num_nodes
    out = {k: np.full((nodes, nodes), np.nan, dtype=np.float32) for k in METRICS}
    for rnd, times in _ran(m.inter):
        if rnd.kind != kind:
            continue
        a = np.flatnonzero(rnd.partner >= 0)
        for i, key in enumerate(METRICS):
            out[key][a, rnd.partner[a]] = times[a, i]
    return out


def _fit_rates(values: np.ndarray, combine) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """(out, in, fabric, prediction) of a per-node model of a (nodes, nodes) figure."""
    fabric = float(np.nanmedian(values))
    out = _median_or(values, 1, fabric)
    inn = _median_or(values, 0, fabric)
    return out, inn, fabric, combine(out[:, None], inn[None, :])


def inter_level(m: Measurements, small_bytes: int, large_bytes: int) -> InterFit:
    nodes = m.num_nodes
    times = inter_times(m, "inter")
    f = figures(times, small_bytes, large_bytes)
    off = ~np.eye(nodes, dtype=bool)
    measured = off & ~np.isnan(f.bandwidth_Bps)
    if nodes > 1 and not measured.any():
        raise PipetteError("probe: no node pair was measured within the budget; raise --budget-s")
    if nodes == 1:
        one = np.zeros((1, 1))
        return InterFit(Figures(one + np.inf, one, one + np.inf, one), np.zeros((1, 1), bool), np.full(1, np.inf),
                        np.full(1, np.inf), math.inf, [], [], 1.0, 0.0)
    out, inn, fabric, predicted = _fit_rates(f.bandwidth_Bps, np.minimum)
    bw = np.where(measured, f.bandwidth_Bps, predicted)
    lat = latency_from_small(times["small_s"], bw, small_bytes)
    lat = np.where(np.isnan(lat), _fit_rates(lat, np.maximum)[3], lat)
    xbw = np.where(np.isnan(f.exchange_bandwidth_Bps), _fit_rates(f.exchange_bandwidth_Bps, np.minimum)[3],
                   f.exchange_bandwidth_Bps)
    xlat = np.where(np.isnan(f.exchange_latency_s), _fit_rates(f.exchange_latency_s, np.maximum)[3],
                    f.exchange_latency_s)
    xbw, xlat = np.fmin(xbw, bw), np.fmax(xlat, lat)
    for matrix, diagonal in ((bw, np.inf), (lat, 0.0), (xbw, np.inf), (xlat, 0.0)):
        np.fill_diagonal(matrix, diagonal)
    slow = measured & (bw < SLOW_LINK_FRACTION * predicted)
    slow_links = [{"nodes": [int(a), int(b)], "bandwidth_Bps": float(bw[a, b]),
                   "predicted_Bps": float(predicted[a, b]),
                   "reason": f"node {a} -> node {b}: {bw[a, b] / 1e9:.3g} GB/s measured, "
                             f"{bw[a, b] / predicted[a, b]:.0%} of what the two nodes' rates predict"}
                  for a, b in zip(*np.nonzero(slow))]
    rate = np.minimum(out, inn)
    slow_nodes = [{"node": int(k), "rate_Bps": float(rate[k]),
                   "reason": f"node {k}: its links run at {rate[k] / 1e9:.3g} GB/s, {rate[k] / fabric:.0%} of "
                             f"the fabric's median"} for k in np.flatnonzero(rate < SLOW_NODE_FRACTION * fabric)]
    factor, extra = _cross_rail(m, bw, lat, small_bytes, large_bytes)
    return InterFit(Figures(bw, lat, xbw, xlat), measured, out, inn, fabric, slow_links, slow_nodes, factor, extra)


def _cross_rail(m: Measurements, bw: np.ndarray, lat: np.ndarray, small_bytes: int,
                large_bytes: int) -> tuple[float, float]:
    """(bandwidth factor, extra latency) of cross-rail pairs against the rail pairs of the same nodes."""
    times = inter_times(m, "cross_rail")
    cross_bw, cross_lat = alpha_beta(times["small_s"], times["large_s"], small_bytes, large_bytes)
    has = ~np.isnan(cross_bw)
    if not has.any():
        return 1.0, 0.0
    factor = float(min(1.0, np.median(cross_bw[has] / bw[has])))
    extra = float(max(0.0, np.median(cross_lat[has] - lat[has])))
    return factor, extra


def domains(inter: InterFit, intra: list[Figures], node_class: np.ndarray) -> np.ndarray | None:
    """NVLink domain of each node: node pairs whose measured rail bandwidth reaches DOMAIN_FRACTION
    of the intra-node median are joined (union-find); None when every node is alone."""
    nodes = node_class.size
    g = intra[0].bandwidth_Bps.shape[-1]
    if nodes == 1 or g == 1:
        return None
    off = ~np.eye(g, dtype=bool)
    inside = float(np.median([np.median(c.bandwidth_Bps[off]) for c in intra]))
    parent = np.arange(nodes)

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in zip(*np.nonzero(inter.measured & (inter.figures.bandwidth_Bps >= DOMAIN_FRACTION * inside))):
        ra, rb = root(int(a)), root(int(b))
        parent[max(ra, rb)] = min(ra, rb)
    labels = np.array([root(k) for k in range(nodes)])
    if np.unique(labels).size == nodes:
        return None
    return np.unique(labels, return_inverse=True)[1]
