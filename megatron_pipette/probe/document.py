"""Turn what every rank measured into the cluster schema document (pure, no torch).

Why separate: rank 0 builds the document from gathered plain data, so the
arithmetic (alpha-beta fit, filling unmeasured pairs, merging collective
timings, listing what the budget skipped) is testable without processes.
See docs/cluster-schema.md for the fields.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_pipette.errors import PipetteError
from megatron_pipette.probe.budget import RoundConfig
from megatron_pipette.probe.schedule import tournament
from megatron_pipette.spec.cluster_file import SCHEMA, VERSION

WELL_CONDITIONED = 0.5
"""Fit beta from the size difference only when t(L) - t(S) >= this fraction of t(L)."""


def gpus_per_node(hosts: Sequence[str]) -> int:
    """Ranks per node, from the host name of each rank in rank order.

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


def medium_bytes(small_bytes: int, large_bytes: int) -> int:
    """The medium exchange size: the power of two nearest the geometric mean of the two sizes
    (128 KiB for 4 KiB and 4 MiB, 512 KiB for 4 KiB and 64 MiB)."""
    return 2 ** round(math.log2(math.sqrt(small_bytes * large_bytes)))


def sender_times(rows: Sequence[Sequence[float]]) -> np.ndarray:
    """(N, N) one-way time from i to j as the sender i timed it (NaN = not measured, or i = j)."""
    m = np.array([np.asarray(r, dtype=float) for r in rows], dtype=float)
    np.fill_diagonal(m, np.nan)
    return m


def pair_times(rows: Sequence[np.ndarray]) -> np.ndarray:
    """(N, N) exchange time per pair from each rank's row of median times (NaN = not measured).

    Both partners timed the same exchange; the one that started later waited
    less for the other, so the smaller of the two is the better estimate.
    Symmetric by construction; the diagonal is NaN.
    """
    m = np.array([np.asarray(r, dtype=float) for r in rows], dtype=float)
    both = np.fmin(m, m.T)          # fmin ignores a NaN on one side
    np.fill_diagonal(both, np.nan)
    return both


def alpha_beta(small_s: np.ndarray, large_s: np.ndarray, small_bytes: int,
               large_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Bandwidth (B/s) and latency (s) per direction from the two acknowledged one-way timings.

    t(S) = 2 alpha + S/beta (the message, then a one-byte reply): beta from
    the difference of the two sizes, alpha from the small one. The difference
    is only trusted when the small message takes at most half the large one's
    time (WELL_CONDITIONED); otherwise a
    noisy small timing could inflate beta without bound, and beta falls back
    to L/t(L), a lower bound that is close when the large message dominates.
    Pairs without a large timing get NaN bandwidth (filled later); latency
    needs the bandwidth, so it is computed after filling by `latency_from_small`.
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


def two_way_alpha_beta(medium_s: np.ndarray, large_s: np.ndarray, medium_bytes: int, large_bytes: int,
                       bw: np.ndarray, lat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-direction bandwidth and latency while the reverse direction is busy, from each pair's
    exchange times at two sizes: t_x(S) = alpha_x + S/beta_x. beta_x comes from the difference
    (else L/t_x(L), as alpha_beta) and is never above the one-way rate (an exchange ends with its
    slower direction, so the faster one is known only to be at least this fast); alpha_x, from
    the medium size, never below the one-way latency: what a link that is not full duplex loses
    on a medium message (acknowledgements queued behind the other direction's data, a
    congestion window that has not opened) shows there."""
    bw_x, _ = alpha_beta(medium_s, large_s, medium_bytes, large_bytes)
    bw_x = np.fmin(bw_x, bw)
    with np.errstate(invalid="ignore", divide="ignore"):
        lat_x = np.fmax(medium_s - medium_bytes / bw_x, lat)
    return bw_x, np.where(np.isnan(bw_x), np.nan, lat_x)


def fill_unmeasured(m: np.ndarray, node_size: int) -> tuple[np.ndarray, list[list[int]]]:
    """Fill NaN off-diagonal entries with the median of measured pairs of the same kind.

    Why: the schema needs full matrices, and a pair the budget left out is
    best guessed by its peers over the same kind of link (intra-node or
    inter-node). When no pair of that kind was measured, the median of all
    measured pairs is used. Each direction is filled on its own. Returns the
    filled matrix and the pairs [i, j] (i < j) with a direction filled.
    """
    n = m.shape[0]
    out = m.copy()
    node = np.arange(n) // node_size
    same = node[:, None] == node[None, :]
    off = ~np.eye(n, dtype=bool)
    measured = off & ~np.isnan(m)
    missing = off & np.isnan(m)
    if missing.any() and not measured.any():
        raise PipetteError("probe: no pair was measured within the budget; raise --budget-s")
    for i, j in zip(*np.nonzero(missing)):
        kind = measured & (same if same[i, j] else ~same)
        out[i, j] = float(np.median(m[kind] if kind.any() else m[measured]))
    filled = sorted({(int(min(i, j)), int(max(i, j))) for i, j in zip(*np.nonzero(missing))})
    return out, [list(p) for p in filled]


def merge_collectives(per_rank: Sequence[Sequence[dict]]) -> list[dict]:
    """One record per group: an all-reduce is as slow as its slowest member."""
    groups: dict[tuple[int, ...], dict] = {}
    for records in per_rank:
        for r in records:
            key = tuple(r["ranks"])
            g = groups.setdefault(key, {"op": r["op"], "ranks": list(key), "bytes": int(r["bytes"]),
                                        "time_s": 0.0})
            g["time_s"] = max(g["time_s"], float(r["time_s"]))
    out = []
    for key in sorted(groups, key=lambda k: (len(k), k)):
        g = groups[key]
        s = len(key)
        algbw = g["bytes"] / g["time_s"] if g["time_s"] > 0 else 0.0
        g["busbw_Bps"] = algbw * 2 * (s - 1) / s   # nccl-tests convention for all-reduce
        out.append(g)
    return [g for g in out if g["time_s"] > 0]


@dataclass(frozen=True)
class RankReport:
    """What one rank sends to rank 0 (plain data, picklable)."""

    identity: dict
    """host, local_rank (None = unknown), device_name, gpu, memory_bytes (None on CPU),
    host_memory_bytes, local_world_size (None = unknown)."""
    gemm_flops: float
    memory_bandwidth_Bps: float
    small_s: list[float]
    """Median acknowledged one-way small-message time to each rank (NaN: not measured, or self)."""
    large_s: list[float]
    """The same for the large message."""
    exchange_s: list[float]
    """Median large two-way exchange time with each rank."""
    exchange_medium_s: list[float]
    """Median medium two-way exchange time with each rank."""
    collectives: list[dict]


def _devices(reports: Sequence[RankReport], gpn: int, hosts: Sequence[str]) -> list[dict]:
    per_host = {h: hosts.count(h) for h in set(hosts)}
    devices = []
    for rank, rep in enumerate(reports):
        ident = rep.identity
        mem = ident.get("memory_bytes")
        if mem is None:   # CPU: share the host's memory among the ranks on it
            local = ident.get("local_world_size") or per_host[ident["host"]]
            mem = int(ident["host_memory_bytes"]) // int(local)
        local_rank = ident.get("local_rank")
        devices.append({"rank": rank, "host": ident["host"],
                        "local_rank": int(local_rank) if local_rank is not None else rank % gpn,
                        "device_name": ident["device_name"], "gpu": ident.get("gpu"),
                        "memory_bytes": int(mem), "memory_bandwidth_Bps": float(rep.memory_bandwidth_Bps),
                        "gemm_flops": float(rep.gemm_flops)})
    return devices


def _round_skips(n: int, configs: Sequence[RoundConfig | None], max_repeats: int) -> list[dict]:
    rounds = tournament(n)
    skipped: list[dict] = []
    cut = [k for k, c in enumerate(configs) if c is not None and c.repeats < max_repeats]
    if cut:
        fewest = min(configs[k].repeats for k in cut)   # type: ignore[union-attr]
        skipped.append({"what": "repeats", "rounds": cut, "requested": max_repeats, "fewest": fewest,
                        "reason": f"budget: {len(cut)} of {len(rounds)} rounds ran fewer than "
                                  f"{max_repeats} repeats (as few as {fewest})"})
    small_only = [k for k, c in enumerate(configs) if c is not None and not c.large]
    if small_only:
        skipped.append({"what": "large_message", "rounds": small_only,
                        "pairs": [list(p) for k in small_only for p in rounds[k]],
                        "reason": f"budget: {len(small_only)} rounds timed the small message only; "
                                  f"their bandwidth is the median of measured pairs of the same kind"})
    dropped = [k for k in range(len(rounds)) if k >= len(configs) or configs[k] is None]
    if dropped:
        skipped.append({"what": "rounds", "rounds": dropped,
                        "pairs": [list(p) for k in dropped for p in rounds[k]],
                        "reason": f"budget: {len(dropped)} of {len(rounds)} rounds not run; their pairs' "
                                  f"bandwidth and latency are the median of measured pairs of the same kind"})
    return skipped


def build_document(reports: Sequence[RankReport], *, name: str, precision: str, small_bytes: int,
                   large_bytes: int, round_configs: Sequence[RoundConfig | None], max_repeats: int,
                   probe_meta: dict[str, Any], extra_skipped: Sequence[dict] = ()) -> dict:
    """The cluster document (schema version 1) from every rank's report, in rank order."""
    n = len(reports)
    hosts = [r.identity["host"] for r in reports]
    gpn = gpus_per_node(hosts)
    ts = sender_times([r.small_s for r in reports])
    tl = sender_times([r.large_s for r in reports])
    bw, lat = alpha_beta(ts, tl, small_bytes, large_bytes)
    two_way_bw, two_way_lat = two_way_alpha_beta(
        pair_times([r.exchange_medium_s for r in reports]), pair_times([r.exchange_s for r in reports]),
        medium_bytes(small_bytes, large_bytes), large_bytes, bw, lat)
    if n > 1:
        bw, _filled_bw = fill_unmeasured(bw, gpn)
        two_way_bw, _ = fill_unmeasured(two_way_bw, gpn)
        two_way_lat, _ = fill_unmeasured(two_way_lat, gpn)
    lat = latency_from_small(ts, bw, small_bytes)   # again: small-only pairs now have a bandwidth
    if n > 1:
        lat, _filled_lat = fill_unmeasured(lat, gpn)

    def matrix(m: np.ndarray) -> list[list[float | None]]:
        return [[None if i == j else float(m[i, j]) for j in range(n)] for i in range(n)]

    skipped = _round_skips(n, round_configs, max_repeats) + list(extra_skipped)
    return {
        "schema": SCHEMA, "version": VERSION, "name": name, "precision": precision,
        "gpus_per_node": gpn,
        "devices": _devices(reports, gpn, hosts),
        "bandwidth_Bps": matrix(bw),
        "latency_s": matrix(lat),
        "exchange_bandwidth_Bps": matrix(np.minimum(two_way_bw, bw)),
        "exchange_latency_s": matrix(np.maximum(two_way_lat, lat)),
        "collectives": merge_collectives([r.collectives for r in reports]),
        "probe": {**probe_meta, "world_size": n, "rounds": len(tournament(n)),
                  "rounds_measured": sum(c is not None for c in round_configs),
                  "small_bytes": int(small_bytes), "large_bytes": int(large_bytes),
                  "exchange_bytes": [medium_bytes(small_bytes, large_bytes), int(large_bytes)],
                  "repeats": int(max_repeats), "skipped": skipped},
    }
