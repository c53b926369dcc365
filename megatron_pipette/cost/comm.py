"""Communication costs on the actual links of each process group (alpha-beta).

`group_links` summarises, once per rank grid and placement, the links every
tensor-, pipeline-, data-parallel and embedding group uses: for a ring
collective the worst latency and the narrowest link of the ring in rank order,
for pipeline hops the latency and bandwidth of each TP rank's own link. The
per-layout costs are then a few vectorised array operations, so the planner
can price thousands of layouts that share a grid.

Megatron's default rank order (tp-cp-ep-dp-pp): logical rank
tp_rank + tp * (dp_rank + dp * pp_rank). A placement maps logical rank ->
physical device (the index in the cluster's matrices).

Costs, with n ranks, S bytes in total, alpha the ring's worst two-way latency
and B its narrowest two-way bandwidth (a ring step lasts as long as its slowest
link, and in a step every rank sends and receives at once):
  all-reduce        alpha + 2(n-1) S/(n B)
  reduce-scatter    alpha +  (n-1) S/(n B)   (S = the unsharded size)
  all-gather        alpha +  (n-1) S/(n B)
  p2p message       alpha_link + S / B_link   (two-way alpha and B inside an exchange)
A collective pays one start-up: NCCL runs it as one kernel that pipelines its chunks around
the ring, so the per-step hop latency (about a microsecond on NVLink) hides behind the
chunks in flight rather than adding a message start-up per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_pipette.spec.hardware import Cluster


@dataclass(frozen=True, kw_only=True, eq=False)
class Rings:
    """Ring collectives over many groups of the same size at once."""

    size: int
    """Ranks per group."""
    alpha_s: np.ndarray
    """Worst per-message latency over each group's ring links, seconds (group shape)."""
    inv_bw_s_per_B: np.ndarray
    """1 / the narrowest ring link's bandwidth, seconds per byte (group shape)."""

    def all_reduce_s(self, nbytes: float) -> np.ndarray:
        if self.size == 1:
            return np.zeros_like(self.alpha_s)
        return self.alpha_s + 2 * (self.size - 1) * nbytes / self.size * self.inv_bw_s_per_B

    def reduce_scatter_s(self, nbytes: float) -> np.ndarray:
        """Also the all-gather time of the same (unsharded) size."""
        if self.size == 1:
            return np.zeros_like(self.alpha_s)
        return self.alpha_s + (self.size - 1) * nbytes / self.size * self.inv_bw_s_per_B

    all_gather_s = reduce_scatter_s


def rings(devices: np.ndarray, cluster: Cluster) -> Rings:
    """Rings over the last axis of `devices` (physical device ids), in rank order."""
    n = devices.shape[-1]
    if n == 1:
        z = np.zeros(devices.shape[:-1])
        return Rings(size=1, alpha_s=z, inv_bw_s_per_B=z)
    lat, bw = cluster.link(devices, np.roll(devices, -1, axis=-1), two_way=True)
    return Rings(size=n, alpha_s=lat.max(axis=-1), inv_bw_s_per_B=(1.0 / bw).max(axis=-1))


@dataclass(frozen=True, kw_only=True, eq=False)
class GroupLinks:
    """The links every group of one (TP, PP, DP) grid and placement uses."""

    tp: int
    pp: int
    dp: int
    devices: np.ndarray
    """(pp, dp, tp) physical device of each logical rank."""
    gemm_flops: np.ndarray
    """(pp, dp) attainable GEMM FLOP/s of each tensor-parallel group's slowest device."""
    tensor: Rings
    """Tensor-parallel groups, shape (pp, dp)."""
    data: Rings
    """Data-parallel groups, shape (pp, tp): stage s, TP rank t."""
    embedding: Rings
    """First + last stage groups (tied word embeddings), shape (dp, tp)."""
    hop_alpha_s: np.ndarray
    """(2, pp, dp, tp) latency of hop h's link: [0] activation rank h -> (h+1) % pp, [1] gradient back."""
    hop_inv_bw: np.ndarray
    """(2, pp, dp, tp) 1/bandwidth of the same links, seconds per byte."""
    hop_xchg: tuple[np.ndarray, np.ndarray] | None
    """Latency and 1/bandwidth (each (2, pp, dp, tp)) of the same links inside an exchange;
    None: full duplex (as hop_alpha_s, hop_inv_bw)."""

    def p2p_s(self, nbytes: float) -> np.ndarray:
        """(2, dp, pp): one message on each hop, each TP rank on its own link; the slowest sets it."""
        return _hop_s(nbytes, self.hop_alpha_s, self.hop_inv_bw)

    def exchange_s(self, nbytes: float) -> np.ndarray | None:
        """(2, dp, pp): the same messages while the reverse one runs (None: as p2p_s)."""
        return None if self.hop_xchg is None else _hop_s(nbytes, *self.hop_xchg)


def _hop_s(nbytes: float, alpha: np.ndarray, inv_bw: np.ndarray) -> np.ndarray:
    return (alpha + nbytes * inv_bw).max(axis=3).transpose(0, 2, 1)


def group_links(tp: int, pp: int, dp: int, cluster: Cluster, placement=None) -> GroupLinks:
    """Summarise the links of every group of this grid under this placement (None: identity)."""
    world = tp * pp * dp
    assert world == cluster.world_size, f"TP*PP*DP = {world} but the cluster has {cluster.world_size} devices"
    logical = np.arange(world) if placement is None else np.asarray(placement, dtype=np.int64)
    assert logical.shape == (world,), "a placement maps every logical rank to a device"
    dev = logical.reshape(pp, dp, tp)
    if pp > 1:
        nxt = np.roll(dev, -1, axis=0)
        src, dst = np.stack([dev, nxt]), np.stack([nxt, dev])
        hop_alpha, hop_bw = cluster.link(src, dst)
        hop_inv = 1.0 / hop_bw
        hop_xchg = None
        if not cluster.full_duplex:
            xchg_alpha, xchg_bw = cluster.link(src, dst, two_way=True)
            hop_xchg = (xchg_alpha, 1.0 / xchg_bw)
        ends = np.stack([dev[0], dev[-1]], axis=-1)
    else:
        hop_alpha = hop_inv = np.zeros((2, pp, dp, tp))
        hop_xchg = None
        ends = dev[0][..., None]
    return GroupLinks(
        tp=tp, pp=pp, dp=dp, devices=dev,
        gemm_flops=cluster.gemm_flops[dev].min(axis=2),
        tensor=rings(dev, cluster),
        data=rings(dev.transpose(0, 2, 1), cluster),
        embedding=rings(ends, cluster),
        hop_alpha_s=hop_alpha,
        hop_inv_bw=hop_inv,
        hop_xchg=hop_xchg,
    )
