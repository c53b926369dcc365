"""Round-robin tournament ("circle method") pairing every rank with every other.

Why a tournament: probing N ranks pair by pair, one pair at a time, costs
N(N-1)/2 sequential exchanges; the circle method measures N/2 disjoint pairs
at once, so every pair is met in N-1 rounds (N rounds when N is odd, one rank
sitting out each round). At 1024 GPUs that is 1023 rounds instead of 523,776
exchanges. Pure Python: it is unit-tested without torch.
"""

from __future__ import annotations

Pair = tuple[int, int]


def tournament(n: int) -> list[list[Pair]]:
    """The rounds of an all-pairs tournament over ranks 0..n-1.

    Each round lists disjoint pairs (low, high) with low < high; every
    unordered pair appears in exactly one round. Even n gives n-1 rounds of
    n/2 pairs; odd n gives n rounds of (n-1)/2 pairs, a different rank sitting
    out each round. n <= 1 gives no rounds.
    """
    if n < 0:
        raise ValueError(f"tournament size must be >= 0, got {n}")
    if n <= 1:
        return []
    # Odd n: add a phantom rank; whoever is drawn against it sits out.
    slots = list(range(n)) + ([None] if n % 2 else [])
    m = len(slots)
    rounds: list[list[Pair]] = []
    for _ in range(m - 1):
        pairs: list[Pair] = []
        for i in range(m // 2):
            a, b = slots[i], slots[m - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        # Keep slot 0 fixed, rotate the rest one step clockwise.
        slots = [slots[0], slots[-1], *slots[1:-1]]
    return rounds


def partner_in(pairs: list[Pair], rank: int) -> int | None:
    """The rank paired with `rank` in one round, or None when it sits out."""
    for a, b in pairs:
        if a == rank:
            return b
        if b == rank:
            return a
    return None
