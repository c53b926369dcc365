"""From measured times to link figures: alpha-beta fits, the per-node fill, slow links, classes.

Why: the budget measures every link inside a node but, at scale, only some node pairs; the
rest is filled from a per-node model fitted on what was measured (a node's sending and
receiving rate, the fabric's median): link(a, b) ~ min(out_a, in_b). One slow node shows in
every round it ran, so a few rounds find it; a measured link far below what its two nodes
predict is reported as a slow link. Between nodes the fit works on (nodes, rounds) tables of
what ran and writes each nodes x nodes matrix once; all array work is vectorised (no loop over
pairs), and the exchange figures are fitted on a second thread. A 2048-node document builds in
about half a second on this project's two-core machine (benchmarks/validation/probe_twin.py). Pure: numpy
and the standard library's threads.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from megatron_pipette.errors import PipetteError
from megatron_pipette.probe.engine import METRICS, AllToAllResult, Measurements, PhaseResult
from megatron_pipette.probe.schedule import ALL_TO_ALL_NODES, all_to_all_peers, round_partners
from megatron_pipette.spec.hardware import Cluster

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
    """The six link figures of one level (LinkLevel's), (..., n, n); NaN where not known."""

    bandwidth_Bps: np.ndarray
    latency_s: np.ndarray
    exchange_bandwidth_Bps: np.ndarray
    exchange_latency_s: np.ndarray
    batched_exchange_bandwidth_Bps: np.ndarray | None = None
    batched_exchange_latency_s: np.ndarray | None = None
    """None where the transport does not time batched exchanges apart (NCCL: see TorchTransport)."""


EXCHANGES = (("exchange_medium_s", "exchange_large_s"), ("batched_medium_s", "batched_large_s"))
"""The METRICS of each two-way figure pair: the link's own exchange, and 1F1B's batched one."""


def _timed(times: dict[str, np.ndarray]) -> tuple[tuple[str, str], ...]:
    """EXCHANGES' pairs that were timed (the batched one is NaN throughout where not)."""
    return tuple(pair for pair in EXCHANGES if not np.isnan(times[pair[1]]).all())


def figures(times: dict[str, np.ndarray], small_bytes: int, large_bytes: int) -> Figures:
    """Fit the figures from sender-side times (METRICS -> (..., n, n), row = sender)."""
    bw, lat = alpha_beta(times["small_s"], times["large_s"], small_bytes, large_bytes)
    two_way = [f for medium, large in _timed(times)
               for f in two_way_alpha_beta(pair_min(times[medium]), pair_min(times[large]),
                                           medium_bytes(small_bytes, large_bytes), large_bytes, bw, lat)]
    return Figures(bw, lat, *two_way)


def _ran(phase: PhaseResult) -> list:
    return list(zip(phase.rounds, phase.times))


def _median_or(values: np.ndarray, default: float) -> np.ndarray:
    """Median of the non-NaN entries of each row (last axis), `default` where there are none. One
    sort of the whole array (NaN sorts last) instead of numpy's per-row nanmedian, which loops in
    Python."""
    if values.shape[-1] == 0:
        return np.full(values.shape[:-1], default)
    ordered = np.sort(values, axis=-1)
    count = np.sum(~np.isnan(ordered), axis=-1)
    last = ordered.shape[-1] - 1
    lower = np.take_along_axis(ordered, np.minimum(np.maximum(count - 1, 0) // 2, last)[..., None], axis=-1)[..., 0]
    upper = np.take_along_axis(ordered, np.minimum(count // 2, last)[..., None], axis=-1)[..., 0]
    return np.where(count > 0, (lower + upper) / 2, default)


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
    per_node = _median_or(flat, float(np.nanmedian(flat)))
    flat = np.where(np.isnan(flat), per_node[:, None], flat)
    out = values.copy()
    out[:, off] = flat
    return out


def intra_levels(m: Measurements, small_bytes: int, large_bytes: int) -> tuple[list[Figures], np.ndarray]:
    """(one Figures per class of nodes that measured alike, each node's class)."""
    times = intra_times(m)
    f = figures(times, small_bytes, large_bytes)
    bw = _fill_per_node(f.bandwidth_Bps)
    lat = _fill_per_node(latency_from_small(times["small_s"], bw, small_bytes))
    two_way = [fill(_fill_per_node(m), one_way)
               for m, fill, one_way in ((f.exchange_bandwidth_Bps, np.fmin, bw), (f.exchange_latency_s, np.fmax, lat),
                                        (f.batched_exchange_bandwidth_Bps, np.fmin, bw),
                                        (f.batched_exchange_latency_s, np.fmax, lat)) if m is not None]
    # A node joins the first class whose first node (its seed) it measured alike; the first node
    # alike none seeds the next class. One pass per class, not per node.
    links = bw[:, ~np.eye(m.gpus_per_node, dtype=bool)]
    node_class = np.full(m.num_nodes, -1, dtype=np.int64)
    seeds: list[int] = []
    while (free := np.flatnonzero(node_class < 0)).size:
        seed = int(free[0])
        alike = np.abs(np.log(links[free] / links[seed])).max(axis=1) <= math.log(CLASS_TOLERANCE)
        node_class[free[alike]] = len(seeds)
        seeds.append(seed)
    classes = []
    for k in range(len(seeds)):
        members = node_class == k
        classes.append(Figures(*(np.median(a[members], axis=0) for a in (bw, lat, *two_way))))
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


@dataclass(frozen=True)
class RoundTable:
    """The node-pair rounds of one kind that ran, as (nodes, rounds) arrays: entry (n, r) is node
    n's link to its partner in round r. Node-major, so a node's links are one contiguous row:
    the fit's per-node medians sort rows of O(rounds) numbers, and writing a node's links into
    a nodes x nodes matrix stays inside that matrix's row. A tournament meets each node pair in
    one round only, so every measured link is in exactly one cell."""

    partner: np.ndarray
    """(nodes, rounds) partner node; -1 sits out."""
    times: dict[str, np.ndarray]
    """METRICS -> (nodes, rounds) float32 sender-node times (slowest rail; NaN: not measured)."""

    @classmethod
    def of(cls, m: Measurements, kind: str) -> RoundTable:
        ran = [(rnd, t) for rnd, t in _ran(m.inter) if rnd.kind == kind]
        nodes = m.num_nodes
        partner = np.ascontiguousarray(round_partners(nodes, [rnd.index for rnd, _ in ran]).reshape(-1, nodes).T)
        stacked = np.array([t for _, t in ran], dtype=np.float32).reshape(-1, nodes, len(METRICS))
        times = np.ascontiguousarray(stacked.transpose(2, 1, 0))      # (metrics, nodes, rounds)
        times[:, partner < 0] = np.nan
        return cls(partner, dict(zip(METRICS, times)))

    @cached_property
    def _cell(self) -> np.ndarray:
        """(nodes, rounds) flat index of each link in a nodes x nodes matrix (0 where none)."""
        nodes = self.partner.shape[0]
        cell = self.partner + np.arange(nodes)[:, None] * nodes
        cell[self.partner < 0] = 0
        return cell

    @cached_property
    def _reverse_cell(self) -> np.ndarray:
        """(nodes, rounds) flat index, in a (nodes, rounds) table, of each link's opposite (a node
        sitting out: its own cell, which is NaN)."""
        nodes, rounds = self.partner.shape
        cell = np.where(self.partner >= 0, self.partner, np.arange(nodes)[:, None])
        cell *= rounds
        cell += np.arange(rounds)
        return cell

    def warm(self) -> None:
        """Build the cached indices once, before threads share the table."""
        _ = self._cell, self._reverse_cell

    def reverse(self, values: np.ndarray) -> np.ndarray:
        """(nodes, rounds) values of the opposite links: partner -> node (NaN where none: `values`
        are NaN where a node sits out, as every figure of the table's times is)."""
        return values.ravel()[self._reverse_cell]

    def at(self, matrix: np.ndarray) -> np.ndarray:
        """(nodes, rounds) entries of a nodes x nodes matrix at each node's link to its partner."""
        return np.where(self.partner >= 0, matrix.ravel()[self._cell], np.nan)

    def cells(self, where: np.ndarray) -> np.ndarray:
        """Flat nodes x nodes indices of the links where `where` ((nodes, rounds) bool) holds."""
        return self._cell[where]

    def combine(self, out: np.ndarray, inn: np.ndarray, combine) -> np.ndarray:
        """(nodes, rounds) `combine(out[node], inn[partner])` of per-node vectors, at each link."""
        return np.where(self.partner >= 0, combine(out[:, None], inn[np.maximum(self.partner, 0)]), np.nan)

    def fit(self, values: np.ndarray, combine) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(out, in, matrix) of a per-node model of one figure known (non-NaN) at the links: a
        node's sending (receiving) rate is the median of its links out (in), else the fabric's
        median (computed only when some node needs it); the nodes x nodes float32 matrix is
        `combine(out[a], in[b])` with the known values written at their links. The matrix is the
        only nodes x nodes array a figure allocates, in the float32 the document stores: min and
        max commute with the rounding, so its entries are those of the float64 prediction rounded."""
        out, inn = _median_or(values, np.nan), _median_or(self.reverse(values), np.nan)
        if np.isnan(out).any() or np.isnan(inn).any():
            fabric = _fabric(values)
            out, inn = np.where(np.isnan(out), fabric, out), np.where(np.isnan(inn), fabric, inn)
        matrix = combine(out.astype(np.float32)[:, None], inn.astype(np.float32)[None, :])
        known = ~np.isnan(values)
        matrix.ravel()[self.cells(known)] = values[known]
        return out, inn, matrix


def _fabric(values: np.ndarray) -> float:
    """The median of every known (non-NaN) value of one figure: the fabric's."""
    known = values[~np.isnan(values)]
    return float(np.median(known)) if known.size else np.nan


def _exchange_matrices(table: RoundTable, bw_at: np.ndarray, lat_at: np.ndarray, small_bytes: int,
                       large_bytes: int) -> list[np.ndarray]:
    """The nodes x nodes matrices of each timed pair of EXCHANGES (bandwidth, latency, in its order):
    `two_way_alpha_beta` at the table's links (each exchange time paired with the partner's own),
    then the per-node fit of each."""
    t, out = table.times, []
    for medium, large in _timed(t):
        xbw, xlat = two_way_alpha_beta(np.fmin(t[medium], table.reverse(t[medium])),
                                       np.fmin(t[large], table.reverse(t[large])),
                                       medium_bytes(small_bytes, large_bytes), large_bytes, bw_at, lat_at)
        out += [table.fit(xbw, np.minimum)[2], table.fit(xlat, np.maximum)[2]]
    return out


def inter_level(m: Measurements, small_bytes: int, large_bytes: int) -> InterFit:
    nodes = m.num_nodes
    table = RoundTable.of(m, "inter")
    bw_at, lat_measured = alpha_beta(table.times["small_s"], table.times["large_s"], small_bytes, large_bytes)
    measured_at = ~np.isnan(bw_at)
    if nodes > 1 and not measured_at.any():
        raise PipetteError("probe: no node pair was measured within the budget; raise --budget-s")
    if nodes == 1:
        one = np.zeros((1, 1))
        return InterFit(Figures(one + np.inf, one, one + np.inf, one), np.zeros((1, 1), bool), np.full(1, np.inf),
                        np.full(1, np.inf), math.inf, [], [], 1.0, 0.0)
    # What the fit reads is worked out at the links, from the measured values and the rate
    # vectors; each nodes x nodes matrix is written once. The exchange figures are fitted on a
    # thread beside the one-way ones (numpy's sorts and copies release the GIL): the build
    # time, not the document, depends on the cores.
    table.warm()
    with ThreadPoolExecutor(max_workers=1) as pool:
        exchange = pool.submit(_exchange_matrices, table, bw_at, lat_measured, small_bytes, large_bytes)
        fabric = _fabric(bw_at)
        out, inn, bw = table.fit(bw_at, np.minimum)
        predicted_at = table.combine(out, inn, np.minimum)
        lat = table.fit(latency_from_small(table.times["small_s"], np.where(measured_at, bw_at, predicted_at),
                                           small_bytes), np.maximum)[2]
        two_way = exchange.result()
    for matrix, diagonal in ((bw, np.inf), (lat, 0.0)):
        np.fill_diagonal(matrix, diagonal)
    for xbw, xlat in zip(two_way[::2], two_way[1::2]):     # never faster than one way
        np.fmin(xbw, bw, out=xbw)
        np.fmax(xlat, lat, out=xlat)
        np.fill_diagonal(xbw, np.inf)
        np.fill_diagonal(xlat, 0.0)
    measured = np.zeros((nodes, nodes), dtype=bool)
    measured.ravel()[table.cells(measured_at)] = True
    slow_at = measured_at & (bw_at < SLOW_LINK_FRACTION * predicted_at)
    slow = sorted(zip(np.nonzero(slow_at)[0].tolist(), table.partner[slow_at].tolist()))
    slow_links = [{"nodes": [a, b], "bandwidth_Bps": float(bw[a, b]), "predicted_Bps": float(min(out[a], inn[b])),
                   "reason": f"node {a} -> node {b}: {bw[a, b] / 1e9:.3g} GB/s measured, "
                             f"{bw[a, b] / min(out[a], inn[b]):.0%} of what the two nodes' rates predict"}
                  for a, b in slow]
    rate = np.minimum(out, inn)
    slow_nodes = [{"node": int(k), "rate_Bps": float(rate[k]),
                   "reason": f"node {k}: its links run at {rate[k] / 1e9:.3g} GB/s, {rate[k] / fabric:.0%} of "
                             f"the fabric's median"} for k in np.flatnonzero(rate < SLOW_NODE_FRACTION * fabric)]
    factor, extra = _cross_rail(m, bw, lat, small_bytes, large_bytes)
    return InterFit(Figures(bw, lat, *two_way), measured, out, inn, fabric, slow_links, slow_nodes, factor, extra)


def _cross_rail(m: Measurements, bw: np.ndarray, lat: np.ndarray, small_bytes: int,
                large_bytes: int) -> tuple[float, float]:
    """(bandwidth factor, extra latency) of cross-rail pairs against the rail pairs of the same nodes."""
    table = RoundTable.of(m, "cross_rail")
    cross_bw, cross_lat = alpha_beta(table.times["small_s"], table.times["large_s"], small_bytes, large_bytes)
    has = ~np.isnan(cross_bw)
    if not has.any():
        return 1.0, 0.0
    factor = float(min(1.0, np.median(cross_bw[has] / table.at(bw)[has])))
    extra = float(max(0.0, np.median(cross_lat[has] - table.at(lat)[has])))
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


@dataclass(frozen=True)
class AllToAllFit:
    """The all-to-all's share of its links' rate (Cluster.all_to_all_bandwidth_factor)."""

    factor: float
    """The median over the blocks timed of each one's share, at most 1."""
    block_share: list[float]
    """Each block's share (NaN where it sat out or its traffic stays inside an NVLink domain)."""


def all_to_all_fit(result: AllToAllResult | None, links: Cluster) -> AllToAllFit | None:
    """What the all-to-all blocks attained against the probed links (`links`, whose own factor is
    1): per block, the links' price of its slowest rank's traffic beyond the NVLink domain over
    the time it measured (median of the repeats) less the start-up; None where none was timed or
    every block stays inside an NVLink domain (GB200 NVL72's 18 hosts: blocks of four share one),
    which the factor does not describe."""
    if result is None or result.block_s.shape[1] == 0:
        return None
    ranks = np.arange(links.world_size)
    alpha, near, far = links.all_to_all_sums(ranks, all_to_all_peers(ranks, links.num_nodes, links.gpus_per_node))
    starts = np.arange(0, links.world_size, ALL_TO_ALL_NODES * links.gpus_per_node)   # blocks: runs of ranks
    price = np.maximum.reduceat(result.bytes_per_peer * far, starts)
    alpha = np.maximum.reduceat(alpha, starts)
    inside = np.maximum.reduceat(near, starts) > 0
    timed = np.isfinite(result.block_s).any(axis=1)
    measured = np.full(timed.size, np.nan)
    measured[timed] = np.nanmedian(result.block_s[timed], axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(inside | ~(price > 0), np.nan, price / (measured - alpha))
    share[~np.isfinite(share) | ~(share > 0)] = np.nan
    if np.isnan(share).all():
        return None
    return AllToAllFit(factor=float(min(1.0, np.nanmedian(share))), block_share=share.tolist())
