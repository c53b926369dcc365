"""Communication costs on the actual links of each process group (alpha-beta).

`group_links` summarises, once per rank grid and placement, the links every
tensor-, context-, pipeline-, data-parallel, embedding and expert group uses:
for a ring collective the worst latency and the narrowest link of the ring in
rank order, for an all-to-all the busiest rank's sum over its peers, for
pipeline hops the latency and bandwidth of each TP rank's own link. The
per-layout costs are then a few vectorised array operations, so the planner
can price thousands of layouts that share a grid.

Logical ranks are in Megatron's default rank order (tp-cp-ep-dp-pp), their
dense and expert grids read from spec.ranks. Groups are named as Megatron's order strings name
them (tp, cp, dp-cp, pp, ep, etp, etp-ep, edp): GroupLinks.dp_cp_groups is the 'dp-cp' group, in
the spelling a Python name allows (megatron-core's ProcessGroupCollection.dp_cp).
A placement maps logical rank -> physical device (the index in the cluster's
matrices). A pipeline replica is one (dp_rank, cp_rank): the context-parallel
ranks of a replica run the same schedule in lock step.

Costs, with n ranks, S bytes in total, alpha the ring's worst two-way latency
and B its narrowest two-way bandwidth (a ring step lasts as long as its slowest
link, and in a step every rank sends and receives at once; where the ring leaves
a node that holds k of its ranks it does so on k rails at once, so that edge has
k times the per-rail figure, shared among the ring's exits from the node):
  all-reduce        alpha + 2(n-1) S/(n B)
  reduce-scatter    alpha +  (n-1) S/(n B)   (S = the unsharded size)
  all-gather        alpha +  (n-1) S/(n B)
  p2p message       alpha_link + S / B_link   (two-way alpha and B inside an exchange)
  all-to-all        alpha + S/n max over ranks of max(sum over peers in its NVLink domain of 1/B,
                    sum over peers outside it of 1/B)   (S = what one rank sends, its own share
                    included; NVLink and the NICs carry their parts at once, and each shares one
                    rank's port among its peers)
A collective pays one start-up: NCCL runs it as one kernel that pipelines its chunks around
the ring, so the per-step hop latency (about a microsecond on NVLink) hides behind the
chunks in flight rather than adding a message start-up per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from megatron_pipette.spec.hardware import Cluster
from megatron_pipette.spec.ranks import dense_grid, expert_grid


@dataclass(frozen=True, kw_only=True, eq=False)
class LinkSummary:
    """Many groups of the same size at once, each summarised by a latency and a cost per byte."""

    size: int
    """Ranks per group."""
    alpha_s: np.ndarray
    """Start-up latency of each group's collective, seconds (group shape)."""
    inv_bw_s_per_B: np.ndarray
    """Seconds per byte on each group's bottleneck (group shape)."""

    def _seconds(self, bottleneck_bytes: float) -> np.ndarray:
        """One collective that moves `bottleneck_bytes` over the bottleneck; free in a group of one."""
        if self.size == 1:
            return np.zeros_like(self.alpha_s)
        return self.alpha_s + bottleneck_bytes * self.inv_bw_s_per_B


class Rings(LinkSummary):
    """Ring collectives: alpha the worst latency over the ring's links, the cost per byte that of
    its narrowest link."""

    def all_reduce_s(self, nbytes: float) -> np.ndarray:
        return self._seconds(2 * (self.size - 1) * nbytes / self.size)

    def reduce_scatter_s(self, nbytes: float) -> np.ndarray:
        """Also the all-gather time of the same (unsharded) size."""
        return self._seconds((self.size - 1) * nbytes / self.size)

    all_gather_s = reduce_scatter_s


def rings(devices: np.ndarray, cluster: Cluster) -> Rings:
    """Rings over the last axis of `devices` (physical device ids), in rank order."""
    n = devices.shape[-1]
    if n == 1:
        z = np.zeros(devices.shape[:-1])
        return Rings(size=1, alpha_s=z, inv_bw_s_per_B=z)
    nxt = np.roll(devices, -1, axis=-1)
    lat, bw = cluster.link(devices, nxt, two_way=True)
    node = devices // cluster.gpus_per_node
    leaves = node != nxt // cluster.gpus_per_node
    if leaves.any():
        bw = bw * _rails_per_exit(node, leaves)
    return Rings(size=n, alpha_s=lat.max(axis=-1), inv_bw_s_per_B=(1.0 / bw).max(axis=-1))


def _rails_per_exit(node: np.ndarray, leaves: np.ndarray) -> np.ndarray:
    """Per ring edge (last axis: a ring's ranks), how many rails carry it: where the edge leaves
    node u, the ring's ranks on u over the ring's edges that leave u (1 inside a node). A ring
    with k ranks on a node crosses to the next node on k rails at once: NCCL runs one channel per
    rail (DGX nodes: one NIC per GPU), gloo's one stream gets the node's shared link, whose
    per-rail figure is its share under every rail's load (docs/cluster-schema.md)."""
    rows = node.reshape(-1, node.shape[-1])
    keyed = rows + (rows.max() + 1) * np.arange(len(rows))[:, None]
    _, where, ranks = np.unique(keyed, return_inverse=True, return_counts=True)
    exits = np.bincount(where.ravel(), weights=leaves.ravel(), minlength=len(ranks))
    share = ranks[where] / np.maximum(exits[where], 1)
    return np.where(leaves, share.reshape(node.shape), 1.0)


@dataclass(frozen=True, kw_only=True, eq=False)
class AllToAll(LinkSummary):
    """All-to-alls: alpha the worst latency between two ranks of the group, the cost per byte the
    busiest rank's sum over its peers (module docstring), per byte of one peer's share; where
    asked for, the two sums apart (inside the rank's NVLink domain, and beyond it)."""

    near_inv_bw_s_per_B: np.ndarray | None = None
    """The busiest rank's sum of 1/B over its peers in its NVLink domain (group shape); None: not kept."""
    far_inv_bw_s_per_B: np.ndarray | None = None
    """The same over its peers beyond its NVLink domain."""

    def all_to_all_s(self, nbytes: float, far_share: float = 1.0, near_share: float = 1.0) -> np.ndarray:
        """`far_share` and `near_share`: what reaches each peer beyond and inside the rank's NVLink
        domain, relative to an all-to-all's equal share (a dispatcher that sends a token once per
        remote node and fans it out there sends less beyond, more inside)."""
        if far_share == near_share == 1.0:
            return self._seconds(nbytes / self.size)
        assert self.far_inv_bw_s_per_B is not None, "all_to_all(..., split=True) keeps the two sums apart"
        if self.size == 1:
            return np.zeros_like(self.alpha_s)
        return self.alpha_s + nbytes / self.size * np.maximum(near_share * self.near_inv_bw_s_per_B,
                                                              far_share * self.far_inv_bw_s_per_B)


def all_to_all(devices: np.ndarray, cluster: Cluster, *, split: bool = False) -> AllToAll:
    """All-to-alls over the last axis of `devices`: n - 1 rotations of the group, each a vector of
    links (Cluster.all_to_all_links); `split` keeps the links inside and beyond the NVLink domain apart."""
    n = devices.shape[-1]
    z = np.zeros(devices.shape[:-1])
    if n == 1:
        return AllToAll(size=1, alpha_s=z, inv_bw_s_per_B=z, near_inv_bw_s_per_B=z if split else None,
                        far_inv_bw_s_per_B=z if split else None)
    alpha, near, far = np.zeros(devices.shape), np.zeros(devices.shape), np.zeros(devices.shape)
    for k in range(1, n):
        lat, inside, beyond = cluster.all_to_all_links(devices, np.roll(devices, -k, axis=-1))
        alpha = np.maximum(alpha, lat)
        near += inside
        far += beyond
    return AllToAll(size=n, alpha_s=alpha.max(axis=-1), inv_bw_s_per_B=np.maximum(near, far).max(axis=-1),
                    near_inv_bw_s_per_B=near.max(axis=-1) if split else None,
                    far_inv_bw_s_per_B=far.max(axis=-1) if split else None)


def _each_array(summary: LinkSummary, fn) -> LinkSummary:
    """The summary with `fn` applied to each of its per-group arrays."""
    return dataclasses.replace(summary, **{f.name: fn(getattr(summary, f.name)) for f in dataclasses.fields(summary)
                                           if isinstance(getattr(summary, f.name), np.ndarray)})


def _worst_per_stage(summary: LinkSummary, groups_axes: tuple[int, ...]) -> LinkSummary:
    """A ring or all-to-all summary reduced to (pp,): the slowest group of each stage sets the pace
    (an MoE layer's dispatch, or a stage's expert-gradient reduction, waits for all of them)."""
    return _each_array(summary, lambda a: a.max(axis=groups_axes))


@dataclass(frozen=True, kw_only=True, eq=False)
class ExpertLinks:
    """The expert grid's groups, each reduced to its slowest group per pipeline stage, (pp,)."""

    dispatch: AllToAll
    """Expert-parallel groups: the alltoall dispatcher's all-to-alls (flex: over ETP x EP)."""
    etp_groups: Rings
    """Expert tensor-parallel groups: the routed rows' all-gather and reduce-scatter."""
    etp_ep_groups: Rings
    """ETP x EP groups: the allgather dispatcher's all-gather and reduce-scatter."""
    edp_groups: Rings
    """Expert data-parallel groups: the experts' gradient reduction and parameter all-gather."""
    gpus_per_domain: int
    """GPUs of an NVLink domain: what the flex dispatcher's groups span beyond it goes over the NICs."""


class Hops(NamedTuple):
    """Seconds of one message on each pipeline hop, per replica."""

    activation: np.ndarray
    """(dp x cp, pp) hop h: the forward's activation, rank h -> (h+1) % pp."""
    gradient: np.ndarray
    """(dp x cp, pp) hop h: the backward's gradient, rank (h+1) % pp -> h."""


@dataclass(frozen=True, kw_only=True, eq=False)
class GroupLinks:
    """The links every group of one rank grid and placement uses."""

    tp: int
    pp: int
    dp: int
    cp: int
    devices: np.ndarray
    """(pp, dp x cp, tp) physical device of each logical rank; axis 1 is the pipeline replica."""
    gemm_flops: np.ndarray
    """(pp, dp x cp) GEMM FLOP/s each tensor-parallel group's slowest device sustains through a step."""
    tp_groups: Rings
    """Tensor-parallel groups, shape (pp, dp x cp)."""
    dp_cp_groups: Rings
    """The dense gradients' groups (data x context parallel), shape (pp, tp): stage s, TP rank t."""
    cp_groups: Rings
    """Context-parallel rings (the key/value exchange), per replica: (pp, dp x cp), worst TP rank."""
    cp_a2a_groups: AllToAll
    """Context-parallel all-to-alls (--cp-comm-type a2a), per replica as `cp_groups`."""
    embedding_groups: Rings
    """First + last stage groups (tied word embeddings), shape (dp x cp, tp)."""
    experts: ExpertLinks | None
    """The expert grid's groups; None for a dense model."""
    hop_alpha_s: np.ndarray
    """(2, pp, dp x cp, tp) latency of hop h's link: [0] activation rank h -> (h+1) % pp, [1] gradient back."""
    hop_inv_bw: np.ndarray
    """(2, pp, dp x cp, tp) 1/bandwidth of the same links, seconds per byte."""
    hop_xchg: tuple[np.ndarray, np.ndarray] | None
    """Latency and 1/bandwidth (each (2, pp, dp x cp, tp)) of the same links inside an exchange;
    None: full duplex (as hop_alpha_s, hop_inv_bw)."""
    host_link_Bps: float | None = None
    """Each device's one-way copy rate to host memory (Cluster.host_link_Bps), None where not known."""

    def p2p_s(self, nbytes: float) -> Hops:
        """One message on each hop, each TP rank on its own link; the slowest sets it."""
        return _hop_s(nbytes, self.hop_alpha_s, self.hop_inv_bw)

    def exchange_s(self, nbytes: float) -> Hops | None:
        """The same messages while the reverse one runs (None: as p2p_s)."""
        return None if self.hop_xchg is None else _hop_s(nbytes, *self.hop_xchg)


def _hop_s(nbytes: float, alpha: np.ndarray, inv_bw: np.ndarray) -> Hops:
    return Hops(*(alpha + nbytes * inv_bw).max(axis=3).transpose(0, 2, 1))


def group_links(tp: int, pp: int, dp: int, cluster: Cluster, placement=None, *, cp: int = 1, ep: int = 1,
                etp: int | None = None, experts: bool = False, dispatch: AllToAll | None = None,
                flex: bool = False) -> GroupLinks:
    """Summarise the links of every group of this grid under this placement (None: identity);
    `experts`: also the expert grid's (ETP None: TP, Megatron's default), with `dispatch` the
    expert-parallel all-to-alls of this placement where the caller has them (expert_dispatch;
    `flex`: the flex dispatcher's, over ETP x EP)."""
    world = tp * cp * pp * dp
    assert world == cluster.world_size, f"TP*CP*PP*DP = {world} but the cluster has {cluster.world_size} devices"
    logical = np.arange(world) if placement is None else np.asarray(placement, dtype=np.int64)
    assert logical.shape == (world,), "a placement maps every logical rank to a device"
    grid = dense_grid(tp=tp, cp=cp, dp=dp, pp=pp)
    dev = logical[grid.array("pp", "dp-cp", "tp")]
    if pp > 1:
        nxt = np.roll(dev, -1, axis=0)
        src, dst = np.stack([dev, nxt]), np.stack([nxt, dev])
        hop_alpha, hop_bw = cluster.link(src, dst)
        hop_inv = 1.0 / hop_bw
        hop_xchg = None
        if not cluster.full_duplex:
            xchg_alpha, xchg_bw = cluster.link(src, dst, two_way=True, batched=True)
            hop_xchg = (xchg_alpha, 1.0 / xchg_bw)
        ends = np.stack([dev[0], dev[-1]], axis=-1)
    else:
        hop_alpha = hop_inv = np.zeros((2, pp, dp * cp, tp))
        hop_xchg = None
        ends = dev[0][..., None]
    by_cp = logical[grid.array("pp", "dp", "tp", "cp")]                  # rings over the cp axis

    def per_replica(summary):
        worst = _worst_per_stage(summary, (2,))                            # (pp, dp): worst TP rank
        return dataclasses.replace(worst, alpha_s=np.repeat(worst.alpha_s, cp, axis=1),
                                   inv_bw_s_per_B=np.repeat(worst.inv_bw_s_per_B, cp, axis=1))

    return GroupLinks(
        tp=tp, pp=pp, dp=dp, cp=cp, devices=dev,
        gemm_flops=cluster.step_gemm_flops[dev].min(axis=2),
        tp_groups=rings(dev, cluster),
        dp_cp_groups=rings(logical[grid.array("pp", "tp", "dp-cp")], cluster),
        cp_groups=per_replica(rings(by_cp, cluster)),
        cp_a2a_groups=per_replica(all_to_all(by_cp, cluster)),
        embedding_groups=rings(ends, cluster),
        experts=_expert_links(logical, pp, ep, tp if etp is None else etp, cluster, dispatch, flex) if experts
        else None,
        hop_alpha_s=hop_alpha,
        hop_inv_bw=hop_inv,
        hop_xchg=hop_xchg,
        host_link_Bps=cluster.host_link_Bps,
    )


def expert_dispatch(logical: np.ndarray, ep: int, etp: int, cluster: Cluster, flex: bool = False) -> AllToAll:
    """The all-to-all of every expert-parallel group, (world / (EP x ETP), ETP), in Megatron's
    expert rank order (etp-ep-edp-pp): which groups form depends on EP and ETP alone, not on how
    the rest splits into pipeline stages, so layouts that share EP and ETP share it. `flex`: the
    flex dispatcher's one group over ETP x EP instead, (world / (EP x ETP), 1), its links inside
    and beyond the NVLink domain apart. The groups come expert DP fastest, then PP, so the grid
    with PP 1 (whose expert DP is then world / (EP x ETP)) lists them in the same order."""
    grid = expert_grid(logical.size, etp=etp, ep=ep, pp=1)
    if flex:
        return all_to_all(logical[grid.array("edp", "etp-ep")][:, None, :], cluster, split=True)
    return all_to_all(logical[grid.array("edp", "etp", "ep")], cluster)


def _expert_links(logical: np.ndarray, pp: int, ep: int, etp: int, cluster: Cluster,
                  dispatch: AllToAll | None = None, flex: bool = False) -> ExpertLinks:
    grid = expert_grid(logical.size, etp=etp, ep=ep, pp=pp)
    flat = dispatch if dispatch is not None else expert_dispatch(logical, ep, etp, cluster, flex)
    by_stage = _each_array(flat, lambda a: a.reshape(pp, -1, a.shape[-1]))
    return ExpertLinks(
        dispatch=_worst_per_stage(by_stage, (1, 2)),
        etp_groups=_worst_per_stage(rings(logical[grid.array("pp", "edp", "ep", "etp")], cluster), (1, 2)),
        etp_ep_groups=_worst_per_stage(rings(logical[grid.array("pp", "edp", "etp-ep")], cluster), (1,)),
        edp_groups=_worst_per_stage(rings(logical[grid.array("pp", "ep", "etp", "edp")], cluster), (1, 2)),
        gpus_per_domain=cluster.gpus_per_domain,
    )
