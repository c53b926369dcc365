"""Rank placement: which physical node runs which logical node of Megatron's rank grid.

Only whole nodes are permuted, so every process keeps its local GPU
(`rank % gpus_per_node == LOCAL_RANK`); when a tensor-parallel group spans the
nodes of an NVLink domain (GB200 NVL72), nodes move in blocks of that many and
start domain-aligned, so the group stays inside its domain. The objective is the same
predicted iteration time that ranks layouts (`CostModel.time`), never a proxy.

The search is a deterministic, bounded best-improvement local search over
node swaps. It starts from Megatron's default order and accepts only strict
improvements, so it is never worse than the default and returns the default
on a uniform cluster; it stops after a round that gained less than MIN_GAIN.
Swaps are tried for the nodes with the weakest links (by the harmonic mean
of their inter-node bandwidths) against one node of every distinct pipeline
role, so a round costs O(pipeline stages) estimates rather than O(nodes^2).

Example: 4 nodes, PP 4 (one stage per node), node 1's links 10x slower.
Default order puts it mid-pipeline with two slow hops; the search moves it
to an end of the pipeline (one slow hop): node_order (0, 3, 2, 1) or similar.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from megatron_pipette.cost.model import CostModel
from megatron_pipette.cost.timing import TimeEstimate
from megatron_pipette.spec.hardware import Cluster
from megatron_pipette.spec.job import Job
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.ranks import dense_grid

WEAK_NODES_PER_ROUND = 3
"""How many of the weakest-linked nodes a round tries to move."""
MAX_ROUNDS = 16
"""Upper bound on accepted swaps; each strictly improves the objective."""
STRICT = 1e-9
"""A swap must beat the current time by this fraction, so float noise never counts as a gain."""
MIN_GAIN = 1e-3
"""The search stops after a round that saved less than this fraction of the iteration time. Smaller
gains are below what the probe resolves (links measured to a few percent): on the probe twin's
2048-node cluster, chasing them ran all MAX_ROUNDS rounds of full estimates for one layout
(1,502 instead of 192) to gain 0.16%."""


@dataclass(frozen=True)
class Placement:
    """node_order[k] = physical node that runs logical node k."""

    node_order: tuple[int, ...]
    gpus_per_node: int

    @cached_property
    def logical_to_physical(self) -> np.ndarray:
        """Physical device (torchrun rank at probe time) of each logical Megatron rank."""
        order = np.asarray(self.node_order)
        local = np.arange(self.gpus_per_node)
        return (order[:, None] * self.gpus_per_node + local[None, :]).reshape(-1)

    @cached_property
    def physical_to_logical(self) -> np.ndarray:
        """The new rank of each process when torch.distributed is re-initialised."""
        inverse = np.empty_like(self.logical_to_physical)
        inverse[self.logical_to_physical] = np.arange(self.logical_to_physical.size)
        return inverse

    @property
    def is_permutation(self) -> bool:
        """Every one of its nodes runs exactly one logical node (a plan document may say otherwise)."""
        return sorted(self.node_order) == list(range(len(self.node_order)))

    @property
    def is_default(self) -> bool:
        return self.node_order == tuple(range(len(self.node_order)))

    def swapped(self, a: int, b: int, unit: int = 1) -> Placement:
        """Logical blocks a and b (of `unit` consecutive logical nodes each) trade their physical nodes."""
        order = list(self.node_order)
        order[a * unit:(a + 1) * unit], order[b * unit:(b + 1) * unit] = \
            order[b * unit:(b + 1) * unit], order[a * unit:(a + 1) * unit]
        return Placement(tuple(order), self.gpus_per_node)


def default_placement(cluster: Cluster) -> Placement:
    """Megatron's own order: logical rank = torchrun rank."""
    return Placement(tuple(range(cluster.num_nodes)), cluster.gpus_per_node)


ROW_BLOCK = 512
"""Rows of the node x node matrix handled at once, so no temporary is another N x N array."""


def node_link_weakness(cluster: Cluster) -> np.ndarray:
    """Per node, the mean of 1/bandwidth over its links to and from the other nodes (higher = weaker)."""
    n = cluster.num_nodes
    bw = cluster.inter_node.bandwidth_Bps
    out_sum, in_sum = np.zeros(n), np.zeros(n)
    for start in range(0, n, ROW_BLOCK):
        rows = slice(start, min(n, start + ROW_BLOCK))
        inv = 1.0 / bw[rows]
        inv[np.arange(inv.shape[0]), np.arange(start, rows.stop)] = 0.0   # a node's link to itself
        out_sum[rows] = inv.sum(axis=1)
        in_sum += inv.sum(axis=0)
    return (out_sum + in_sum) / max(1, 2 * (n - 1))


def _role_representatives(layout: Layout, cluster: Cluster, unit: int) -> list[int]:
    """One block of `unit` logical nodes per distinct set of pipeline stages, ends of the pipeline first."""
    size = cluster.gpus_per_node * unit
    grid = dense_grid(tp=layout.tp, cp=layout.cp, dp=layout.dp, pp=layout.pp)
    stage_of_rank = grid.coordinates(np.arange(grid.world_size))["pp"]
    seen: dict[tuple[int, ...], int] = {}
    for k in range(cluster.num_nodes // unit):
        role = tuple(np.unique(stage_of_rank[k * size:(k + 1) * size]))
        seen.setdefault(role, k)
    last = layout.pp - 1
    return sorted(seen.values(),
                  key=lambda k: (min(abs(stage_of_rank[k * size]), abs(last - stage_of_rank[k * size])), k))


def domain_aligned(cluster: Cluster, unit: int) -> Placement:
    """The order that keeps every block of `unit` consecutive logical nodes (one tensor-parallel group
    wider than a node) inside one NVLink domain: nodes sorted by domain, torchrun order kept within."""
    return Placement(tuple(np.argsort(cluster.domains, kind="stable").tolist()), cluster.gpus_per_node)


def optimize_placement(model: CostModel, job: Job) -> tuple[Placement, TimeEstimate]:
    """The best node permutation found, and its predicted time (same model as the ranking).

    Nodes move in blocks of `unit` = TP / GPUs per node (1 when TP fits in a node), so a
    tensor-parallel group that spans the nodes of an NVLink domain stays inside it."""
    cluster, layout = model.cluster, job.layout
    unit = max(1, layout.tp // cluster.gpus_per_node)
    current = default_placement(cluster) if unit == 1 else domain_aligned(cluster, unit)
    best = model.time(job, current.logical_to_physical)
    blocks = cluster.num_nodes // unit
    if blocks == 1:
        return current, best
    weakness = node_link_weakness(cluster)
    if np.ptp(weakness) <= 1e-12 * weakness.max():
        return current, best  # uniform fabric: every whole-node permutation costs the same
    targets = _role_representatives(layout, cluster, unit)
    exhaustive = blocks <= 8
    for _ in range(MAX_ROUNDS):
        logical_of_physical = np.argsort(np.asarray(current.node_order))
        block_weakness = np.zeros(blocks)
        np.add.at(block_weakness, logical_of_physical // unit, weakness)
        movers = np.argsort(-block_weakness, kind="stable")[:WEAK_NODES_PER_ROUND].tolist()
        pairs = ([(a, b) for a in range(blocks) for b in range(a + 1, blocks)]
                 if exhaustive else [(a, b) for a in movers for b in targets if a != b])
        found, before = None, best.iteration_time_s
        for a, b in pairs:
            trial = current.swapped(a, b, unit)
            estimate = model.time(job, trial.logical_to_physical)
            if estimate.iteration_time_s < best.iteration_time_s * (1 - STRICT):
                found, best = trial, estimate
        if found is None:
            break
        current = found
        if best.iteration_time_s > before * (1 - MIN_GAIN):
            break
    return current, best
