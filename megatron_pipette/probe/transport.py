"""What the probe needs from the ranks it runs on: the transport interface.

Why an interface: the probe's logic (`probe.engine`: round scheduling, budget
decisions, what is gathered where) is written once and runs on two transports:
torch.distributed on the real job (`probe.torch_transport`, one process per
rank, `ranks` = [its rank]) and the probe twin (`probe.twin`, one process
playing every rank at once, `ranks` = all of them, message times from a truth
cluster file). Every method is vectorised over the ranks this process plays, so
the engine never loops over ranks. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class PairTimes:
    """One round's medians for each rank this process plays (NaN: sat out, or size not timed)."""

    small_s: np.ndarray
    """One-way small message to the partner, acknowledged by one byte (the sender's time)."""
    large_s: np.ndarray
    """One-way large message to the partner, acknowledged."""
    exchange_medium_s: np.ndarray
    """Medium message both ways at once with the partner, the lower rank's send posted first and
    the higher rank's receive (the link's own two-way rate)."""
    exchange_large_s: np.ndarray
    """Large message both ways at once."""
    batched_medium_s: np.ndarray
    """Medium message both ways at once, posted as megatron-core's 1F1B posts it (one batch, the
    send first on both sides): the mean of a train of such exchanges back to back, as a pipeline
    hop runs them in the steady state."""
    batched_large_s: np.ndarray
    """Large message, as batched_medium_s."""
    small_wall_s: np.ndarray
    """Wall time of one repeat of the small part (both directions), this rank's median."""
    large_wall_s: np.ndarray
    """Wall time of one repeat of the large part (both directions, both exchanges and a repeat's share
    of the batched trains), on this rank."""


class Transport(Protocol):
    """The ranks of one probe. Every call is collective: all ranks make it, in the same order."""

    world_size: int
    gpus_per_node: int
    ranks: np.ndarray
    """The global ranks this process plays."""
    is_root: bool
    """True for the process that plays rank 0 (it builds the document)."""

    def elapsed(self) -> float:
        """Seconds since the probe started (after its first barrier), on this process's clock."""

    def compute(self, gemm_window_s: float, copy_window_s: float) -> tuple[np.ndarray, np.ndarray]:
        """(GEMM FLOP/s, copy bytes/s) each played rank attains while every rank computes at once."""

    def gather_max(self, slots: np.ndarray, values: np.ndarray, num_slots: int) -> np.ndarray:
        """(num_slots, m): row s is the element-wise max of every row of `values` (R, m), from all
        ranks, whose slot is s; -inf where none. Also a barrier."""

    def measure_pairs(self, partner: np.ndarray, *, repeats: int, large: bool, warm_up: bool) -> PairTimes:
        """Each played rank with partner[i] (global rank, -1 sits out): `warm_up` first exchanges a
        small message (connection set-up, both partners start together), then `repeats` times the
        one-way small message each way, and with `large` the one-way large message each way, the
        medium and large exchanges, and a train of `repeats` batched exchanges of each size."""

    def measure_all_to_all(self, peers: np.ndarray, *, nbytes: int) -> np.ndarray:
        """(len(ranks),) seconds each played rank takes to send `nbytes` to every rank of its row of
        `peers` (-1: none) and receive as much from each, all at once (an all-to-all on the
        group's communicator); NaN for a rank without peers. The peers are mutual."""
