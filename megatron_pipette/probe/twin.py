"""The probe twin: the real probe's logic, every rank in one process, over simulated messages.

`TwinTransport` implements `probe.transport.Transport` for all N ranks at once: a message of
S bytes from i to j takes alpha + S/beta with the truth cluster's figures for that link
(`Cluster.link`, one-way or inside an exchange), each timing is multiplied by lognormal
noise, and a simulated clock advances by what the real ranks would wait: a round lasts as
long as its slowest pair, a collective by a tree model. The rail-to-rail rounds are exactly
the load the truth's node x node figures are defined under (every local rank of both nodes
busy, each on its own rail), so no further contention applies; cross-rail pairs get the
truth's cross-rail figures, and the all-to-all the truth's all-to-all factor. `probe.engine`
and `probe.document` then run unchanged: the twin is not a second implementation of the
probe. Pure: numpy only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial

import numpy as np

from megatron_pipette.probe.budget import plan_budget
from megatron_pipette.probe.document import build_document
from megatron_pipette.probe.engine import run_engine
from megatron_pipette.probe.fit import medium_bytes
from megatron_pipette.probe.transport import PairTimes
from megatron_pipette.spec.hardware import Cluster

CONNECT_S = 5e-3
"""Assumed set-up of a new peer connection on the probe's one communicator (NCCL connects p2p
channels lazily, on first use): a round with new partners pays it once. Not measured here."""
ACK_BYTES = 1


@dataclass(frozen=True)
class TwinSettings:
    small_bytes: int
    large_bytes: int
    noise: float = 0.0
    """Sigma of the lognormal factor on every timing (0: exact)."""
    seed: int = 0
    connect_s: float = CONNECT_S
    batched: bool = False
    """Also time 1F1B's batched exchanges apart, as the gloo transport does (NCCL's does not)."""


class TwinTransport:
    """Every rank of `truth`, played at once."""

    def __init__(self, truth: Cluster, settings: TwinSettings):
        self.truth, self.s = truth, settings
        self.world_size, self.gpus_per_node = truth.world_size, truth.gpus_per_node
        self.ranks = np.arange(truth.world_size)
        self.is_root = True
        self.clock = 0.0
        self.rng = np.random.default_rng(settings.seed)
        off = ~np.eye(truth.num_nodes, dtype=bool)
        inter_lat, inter_bw = truth.inter_node.figures(False)
        self._tree_alpha = float(np.median(inter_lat[off])) if truth.num_nodes > 1 else float(
            np.median(truth.intra_node[0].latency_s))
        self._tree_bw = float(np.median(inter_bw[off])) if truth.num_nodes > 1 else float(
            np.median(truth.intra_node[0].bandwidth_Bps))

    def elapsed(self) -> float:
        return self.clock

    def _noisy(self, t: np.ndarray, repeats: int = 1) -> np.ndarray:
        """(repeats, ...) samples of the times `t`."""
        if self.s.noise <= 0:
            return np.broadcast_to(t, (repeats, *t.shape))
        return t * self.rng.lognormal(0.0, self.s.noise, (repeats, *t.shape))

    def compute(self, gemm_window_s: float, copy_window_s: float) -> tuple[np.ndarray, np.ndarray]:
        self.clock += gemm_window_s + copy_window_s
        n = self.world_size
        gemm = self.truth.gemm_flops / self._noisy(np.ones(n))[0]
        return gemm, self.truth.memory_bandwidth_Bps / self._noisy(np.ones(n))[0]

    def gather_max(self, slots: np.ndarray, values: np.ndarray, num_slots: int) -> np.ndarray:
        out = np.full((num_slots, values.shape[1]), -np.inf)
        order = np.argsort(slots, kind="stable")
        present, starts = np.unique(slots[order], return_index=True)
        out[present] = np.maximum.reduceat(values[order], starts, axis=0)
        # A tree all-reduce: up and down log2(N) levels, each a start-up and the payload.
        levels = math.ceil(math.log2(max(2, self.world_size)))
        self.clock += 2 * levels * (self._tree_alpha + out.nbytes / self._tree_bw)
        return out

    def _message(self, src: np.ndarray, dst: np.ndarray, nbytes: float, two_way: bool,
                 batched: bool = False) -> np.ndarray:
        lat, bw = self.truth.link(src, dst, two_way=two_way, batched=batched)
        return lat + nbytes / bw

    def measure_pairs(self, partner: np.ndarray, *, repeats: int, large: bool, warm_up: bool) -> PairTimes:
        me = self.ranks
        has = partner >= 0
        src, dst = me[has], partner[has]
        nan = np.full(me.size, np.nan)

        def one_way(nbytes: int) -> np.ndarray:     # the message, then the one-byte acknowledgement back
            return self._message(src, dst, nbytes, False) + self._message(dst, src, ACK_BYTES, False)

        def exchange(nbytes: int, batched: bool = False) -> np.ndarray:    # ends with the slower direction
            return np.maximum(self._message(src, dst, nbytes, True, batched),
                              self._message(dst, src, nbytes, True, batched))

        def sampled(t: np.ndarray, reverse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """(this rank's median, median wall time of a repeat of both directions)."""
            mine, theirs = self._noisy(t, repeats), self._noisy(reverse, repeats)
            return np.median(mine, axis=0), np.median(mine + theirs, axis=0)

        back = np.searchsorted(src, dst)            # partners are mutual: the reverse pair's position
        small_t = one_way(self.s.small_bytes)
        small, small_wall = sampled(small_t, small_t[back])
        result = {f.name: nan.copy() for f in fields(PairTimes)}
        result["small_s"][has], result["small_wall_s"][has] = small, small_wall
        pair_s = self._noisy(exchange(self.s.small_bytes))[0] + self.s.connect_s if warm_up else 0.0
        pair_s = pair_s + repeats * small_wall
        if large:
            large_t = one_way(self.s.large_bytes)
            reverse = large_t[back]
            big, _ = sampled(large_t, reverse)
            sizes = (medium_bytes(self.s.small_bytes, self.s.large_bytes), self.s.large_bytes)
            medium, full = (np.median(self._noisy(exchange(n), repeats), axis=0) for n in sizes)
            wall = large_t + reverse + medium + full
            if self.s.batched:                       # a train's mean per exchange
                batched = [np.mean(self._noisy(exchange(n, batched=True), repeats), axis=0) for n in sizes]
                result["batched_medium_s"][has], result["batched_large_s"][has] = batched
                wall = wall + sum(batched)
            result["large_s"][has], result["exchange_medium_s"][has] = big, medium
            result["exchange_large_s"][has], result["large_wall_s"][has] = full, wall
            pair_s = pair_s + repeats * wall
        if src.size:
            self.clock += float(np.max(pair_s))
        return PairTimes(**result)

    def measure_all_to_all(self, peers: np.ndarray, *, nbytes: int) -> np.ndarray:
        alpha, near, far = self.truth.all_to_all_sums(self.ranks, peers)
        sends = (peers >= 0).any(axis=1)
        t = self._noisy(np.where(sends, alpha + nbytes * np.maximum(near, far), np.nan))[0]
        if sends.any():
            self.clock += float(np.nanmax(t))
        return t


def twin_identities(truth: Cluster) -> list[dict]:
    """What each simulated rank would report about itself (its GPU identity: host and local rank)."""
    name = truth.gpu.name if truth.gpu else "simulated"
    hosts = [truth.hosts[r // truth.gpus_per_node] if truth.hosts else f"node{r // truth.gpus_per_node}"
             for r in range(truth.world_size)]
    return [{"host": host, "device_name": name, "gpu": truth.gpu.name if truth.gpu else None,
             "memory_bytes": truth.memory_bytes, "gpu_id": f"{host}-gpu{r % truth.gpus_per_node}"}
            for r, host in enumerate(hosts)]


@dataclass(frozen=True)
class TwinRun:
    doc: dict
    """The cluster document the probe would write on the truth."""
    simulated_s: float
    """The probe's duration on the truth's links (simulated clock)."""
    document_build_s: float
    """Wall time rank 0 spends building the document (the fits, the filled matrices): real, not simulated."""
    build: Callable[[], dict]
    """Builds the document again from the same measurements (to time it apart from the twin's run)."""


def run_twin(truth: Cluster, *, budget_s: float, small_bytes: int, large_bytes: int, repeats: int,
             noise: float = 0.0, seed: int = 0, precision: str = "bf16",
             known_nodes: np.ndarray | None = None) -> TwinRun:
    """The probe, every rank at once, on the simulated `truth` (`known_nodes`: see probe.engine.run_engine)."""
    transport = TwinTransport(truth, TwinSettings(small_bytes=small_bytes, large_bytes=large_bytes, noise=noise,
                                                  seed=seed))
    measurements = run_engine(transport, plan_budget(budget_s), repeats=repeats, large_bytes=large_bytes,
                              known_nodes=known_nodes)
    build = partial(build_document, measurements, twin_identities(truth), name=f"twin-of-{truth.name}",
                    precision=precision, small_bytes=small_bytes, large_bytes=large_bytes, max_repeats=repeats,
                    probe_meta={"backend": "twin", "budget_s": float(budget_s), "noise": noise, "seed": seed})
    started = time.perf_counter()
    doc = build()
    return TwinRun(doc=doc, simulated_s=transport.clock, document_build_s=time.perf_counter() - started, build=build)


def compare_to_truth(probed: Cluster, truth: Cluster, measured: np.ndarray) -> dict[str, float]:
    """Relative errors of the probed node x node bandwidth against the truth's (rail to rail),
    over the pairs measured (`measured`, (nodes, nodes) bool) and over every pair."""
    nodes = truth.num_nodes
    off = ~np.eye(nodes, dtype=bool)
    if nodes == 1:
        return {}
    with np.errstate(invalid="ignore"):     # the unused diagonal: inf / inf
        error = np.abs(probed.inter_node.bandwidth_Bps / truth.inter_node.bandwidth_Bps - 1)
    return {"median": float(np.median(error[off])), "worst": float(error[off].max()),
            "worst_measured": float(error[off & measured].max()) if (off & measured).any() else float("nan")}
