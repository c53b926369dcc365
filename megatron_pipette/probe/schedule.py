"""Which ranks meet in each probe round: tournaments inside nodes and between nodes.

Why this shape: a GPU-level tournament needs N-1 rounds (1023 at 1024 GPUs). The
probe instead measures the two levels the cluster model has: inside every node
at once (gpus_per_node - 1 rounds), then between nodes (num_nodes - 1 rounds),
where all local ranks of the two nodes of a pair exchange rail to rail at once
(local rank k with local rank k, the load a pipeline-stage boundary puts on the
fabric). Two extra rounds repeat node pairs with shifted rails (local k with
k + gpus_per_node / 2) to price cross-rail traffic. The inter-node rounds run in
a fixed spread order (`inter_round_order`) so that a budget that stops after k
rounds has still shown every node k different partners.

The circle method gives each round N/2 disjoint pairs; every pair meets in
exactly one round. On an allocation some of whose nodes a probe measured before
(`known_nodes`), the pairs between those are not measured again: the inter-node
rounds are the first NEW_NODE_ROUNDS of the spread order in which a new node has a
partner, enough for the per-node fit to price each new node's links (probe.fit).
Pure: unit-tested without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Pair = tuple[int, int]
CROSS_RAIL_ROUNDS = 2
"""Inter-node rounds repeated with shifted rails (the first ones in the spread order)."""
ALL_TO_ALL_NODES = 4
"""Nodes of each block of the probe's all-to-all (`all_to_all_peers`): an expert-parallel group of
32 GPUs over four 8-GPU nodes, as NVIDIA runs Qwen3-235B, the span at which an all-to-all's
many-to-many traffic meets at receivers and in the spine where one node pair's does not."""
ORDER_SEED = 0
NEW_NODE_ROUNDS = 16
"""Inter-node rounds on an allocation with nodes measured before: each new node meets up to this many
partners, from which the fit takes its sending and receiving rates (a whole tournament at 2048 nodes
is 2047 rounds, and the budget ran 1191 of them in 28 s on the probe twin)."""


def rounds_in_tournament(n: int) -> int:
    """n-1 rounds for even n, n for odd n (one sits out each round), none for n <= 1."""
    if n < 0:
        raise ValueError(f"tournament size must be >= 0, got {n}")
    return 0 if n <= 1 else n - 1 if n % 2 == 0 else n


def round_partners(n: int, r: int | np.ndarray) -> np.ndarray:
    """(n,) partner of each of 0..n-1 in round r of the circle-method tournament; -1 sits out
    ((len(r), n) for an array of rounds).

    With m = n rounded up to even (a phantom m-1 for odd n), m-1 stays fixed and meets r; the
    others pair as (r + i, r - i) mod (m - 1), i.e. a meets 2r - a. O(n) per round, vectorised.
    """
    rounds = np.asarray(r, dtype=np.int64)
    assert np.all((rounds >= 0) & (rounds < rounds_in_tournament(n)))
    m = n + n % 2
    a = np.arange(m)
    partner = 2 * rounds[..., None] - a                    # in place from here: one (rounds, m) array
    np.remainder(partner, m - 1, out=partner)
    np.copyto(partner, m - 1, where=a == rounds[..., None])
    partner[..., m - 1] = rounds
    partner = partner[..., :n]
    partner[partner == n] = -1      # drawn against the phantom: sits out
    return partner


def tournament(n: int) -> list[list[Pair]]:
    """The rounds of an all-pairs tournament over 0..n-1, as sorted (low, high) pairs: each
    round's pairs are disjoint and every unordered pair appears in exactly one round."""
    rounds = []
    for r in range(rounds_in_tournament(n)):
        p = round_partners(n, r)
        low = np.flatnonzero((p >= 0) & (np.arange(n) < p))
        rounds.append([(int(a), int(p[a])) for a in low])
    return rounds


def partner_in(pairs: list[Pair], rank: int) -> int | None:
    """The one paired with `rank` in one round, or None when it sits out."""
    for a, b in pairs:
        if a == rank:
            return b
        if b == rank:
            return a
    return None


def inter_round_order(num_nodes: int) -> list[int]:
    """Tournament rounds between nodes in the order the probe runs them: a fixed pseudo-random
    permutation, so any prefix pairs each node with partners spread over the whole allocation
    (the circle method's first rounds pair mostly mirror-image neighbours)."""
    return np.random.default_rng(ORDER_SEED).permutation(rounds_in_tournament(num_nodes)).tolist()


@dataclass(frozen=True)
class Round:
    """One probe round: who meets whom."""

    kind: str
    """"intra" (inside every node at once), "inter" (node pairs, rail to rail) or "cross_rail"
    (node pairs again, local rank k with k + rail_shift)."""
    index: int
    """Round of its tournament: over local ranks for "intra", over nodes otherwise."""
    size: int
    """Players of that tournament: gpus_per_node for "intra", num_nodes otherwise."""
    rail_shift: int = 0

    @property
    def partner(self) -> np.ndarray:
        """(size,) partner local rank ("intra") or node; -1 sits out. Computed on demand: holding
        every round's partners would be O(nodes^2)."""
        return round_partners(self.size, self.index)

    def partner_ranks(self, ranks: np.ndarray, gpus_per_node: int) -> np.ndarray:
        """The partner of each of `ranks` (global ranks; -1 sits out). Vectorised."""
        node, local = np.divmod(np.asarray(ranks), gpus_per_node)
        if self.kind == "intra":
            other = self.partner[local]
            return np.where(other < 0, -1, node * gpus_per_node + other)
        other = self.partner[node]
        shift = np.where(node < other, self.rail_shift, -self.rail_shift)
        return np.where(other < 0, -1, other * gpus_per_node + (local + shift) % gpus_per_node)


def rounds_meeting(num_nodes: int, new: np.ndarray, limit: int) -> list[int]:
    """The first `limit` tournament rounds of the spread order in which some node of `new` ((nodes,)
    bool) has a partner; one round's partners at a time, so O(nodes) a round looked at."""
    found = []
    for k in inter_round_order(num_nodes):
        if len(found) == limit:
            break
        if (round_partners(num_nodes, k)[new] >= 0).any():
            found.append(k)
    return found


def probe_rounds(num_nodes: int, gpus_per_node: int,
                 known_nodes: np.ndarray | None = None) -> tuple[list[Round], list[Round]]:
    """(intra-node rounds, inter-node rounds with the cross-rail rounds interleaved early). With
    `known_nodes` ((nodes,) bool: measured before), only rounds in which a new node meets a partner,
    at most NEW_NODE_ROUNDS (none when every node is known)."""
    intra = [Round("intra", k, gpus_per_node) for k in range(rounds_in_tournament(gpus_per_node))]
    order = inter_round_order(num_nodes) if known_nodes is None else \
        rounds_meeting(num_nodes, ~np.asarray(known_nodes, dtype=bool), NEW_NODE_ROUNDS)
    inter: list[Round] = []
    for position, k in enumerate(order):
        inter.append(Round("inter", k, num_nodes))
        if position < CROSS_RAIL_ROUNDS and gpus_per_node > 1:
            inter.append(Round("cross_rail", k, num_nodes, rail_shift=max(1, gpus_per_node // 2)))
    return intra, inter


def node_pairs_met(num_nodes: int, gpus_per_node: int, inter_rounds_run: int) -> np.ndarray:
    """(nodes, nodes) bool: the node pairs that met rail to rail in the first `inter_rounds_run`
    inter-node rounds (a document's probe.inter_rounds_measured)."""
    met = np.zeros((num_nodes, num_nodes), dtype=bool)
    for rnd in probe_rounds(num_nodes, gpus_per_node)[1][:inter_rounds_run]:
        if rnd.kind == "inter":
            partner = rnd.partner
            has = np.flatnonzero(partner >= 0)
            met[has, partner[has]] = True
    return met


def all_to_all_peers(ranks: np.ndarray, num_nodes: int, gpus_per_node: int) -> np.ndarray:
    """(len(ranks), (ALL_TO_ALL_NODES - 1) x gpus_per_node): the global ranks each of `ranks` sends to
    in the probe's all-to-all, -1 padding. Nodes form blocks of ALL_TO_ALL_NODES in rank order (the
    last may be smaller; alone, it sits out), and every block runs at once: each rank exchanges with
    every rank of its block on the other nodes, in NCCL's all-to-all order (from the rank after
    it, cyclically). Only the traffic between nodes is measured: what the links inside a node carry
    in an all-to-all the intra-node rounds price already. O(ranks) memory, vectorised."""
    ranks = np.asarray(ranks, dtype=np.int64)
    g = gpus_per_node
    node = ranks // g
    first = node // ALL_TO_ALL_NODES * ALL_TO_ALL_NODES
    size = (np.minimum(first + ALL_TO_ALL_NODES, num_nodes) - first) * g          # ranks of the block
    at = ranks - first * g                                                       # place in the block
    k = np.arange(1, ALL_TO_ALL_NODES * g)
    place = (at[:, None] + k) % size[:, None]
    peer = first[:, None] * g + place
    keep = (k < size[:, None]) & (place // g != at[:, None] // g)
    first = np.argsort(~keep, axis=1, kind="stable")[:, :(ALL_TO_ALL_NODES - 1) * g]    # the peers, in order
    return np.where(np.take_along_axis(keep, first, axis=1), np.take_along_axis(peer, first, axis=1), -1)
