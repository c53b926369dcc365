"""The probe's transport on a real job: one process per rank, torch.distributed underneath.

Implements `probe.transport.Transport` for the one rank this process is. Every collective is
an all-reduce MAX on the group's own communicator (on NCCL, with point-to-point batched on it
too, the probe creates no communicator besides the group's: see `probe.comm`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import fields
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_pipette.measure import compute
from megatron_pipette.probe.comm import Clock, all_to_all, batched_exchanges, exchange, one_way
from megatron_pipette.probe.fit import medium_bytes
from megatron_pipette.probe.transport import PairTimes


class TorchTransport:
    """This rank of `group` (None: the world)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, *, gpus_per_node: int,
                 precision: str, small_bytes: int, large_bytes: int, timeout: timedelta):
        self.group, self.device, self.timeout, self.precision = group, device, timeout, precision
        self.world_size, self.gpus_per_node = dist.get_world_size(group), gpus_per_node
        self.me = dist.get_rank(group)
        self.ranks = np.array([self.me])
        self.is_root = self.me == 0
        self.clock = Clock()
        self.small = (torch.zeros(small_bytes, dtype=torch.uint8, device=device),
                      torch.empty(small_bytes, dtype=torch.uint8, device=device))
        self.large = (torch.zeros(large_bytes, dtype=torch.uint8, device=device),
                      torch.empty(large_bytes, dtype=torch.uint8, device=device))
        medium = medium_bytes(small_bytes, large_bytes)
        self.medium = (self.large[0][:medium], self.large[1][:medium])
        self.ack = torch.zeros(1, dtype=torch.uint8, device=device)
        self.gemm_n = 0

    def elapsed(self) -> float:
        return self.clock.elapsed()

    def compute(self, gemm_window_s: float, copy_window_s: float) -> tuple[np.ndarray, np.ndarray]:
        gemm_step, gemm_flops_per_step, self.gemm_n = compute.prepare_gemm(self.device, self.precision)
        copy_step, copy_bytes_per_step = compute.prepare_copy(self.device)
        self.gather_max(np.zeros(1, dtype=np.int64), np.zeros((1, 1)), 1)   # start the windows together
        gemm = compute.gemm_rate(gemm_step, gemm_flops_per_step, gemm_window_s, self.device)
        copy = compute.copy_bandwidth(copy_step, copy_bytes_per_step, copy_window_s, self.device)
        return np.array([gemm]), np.array([copy])

    def gather_max(self, slots: np.ndarray, values: np.ndarray, num_slots: int) -> np.ndarray:
        table = torch.full((num_slots, values.shape[1]), -torch.inf, dtype=torch.float64, device=self.device)
        for slot, row in zip(slots.tolist(), values):
            table[slot] = torch.maximum(table[slot], torch.as_tensor(row, dtype=torch.float64, device=self.device))
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.group)
        return table.cpu().numpy()

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def _both_ways(self, peer: int, bufs: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
        """(this rank's send to peer, wall time): the lower rank sends first, then the higher."""
        start = time.perf_counter()
        times = [one_way(self.group, self.device, self._global(peer), bufs[0] if sending else bufs[1], self.ack,
                         sending, self.timeout) for sending in ((self.me < peer), (self.me > peer))]
        return times[0] if self.me < peer else times[1], time.perf_counter() - start

    def _exchange(self, peer: int, bufs: tuple[torch.Tensor, torch.Tensor]) -> float:
        return exchange(self.group, self.device, self.me, self._global(peer), *bufs, self.timeout)

    def _batched(self, peer: int, bufs: tuple[torch.Tensor, torch.Tensor], count: int) -> float:
        return batched_exchanges(self.group, self.device, self._global(peer), *bufs, count, self.timeout)

    def measure_pairs(self, partner: np.ndarray, *, repeats: int, large: bool, warm_up: bool) -> PairTimes:
        peer = int(partner[0])
        nan = float("nan")
        if peer < 0:
            return PairTimes(*(np.array([nan]) for _ in fields(PairTimes)))
        if warm_up:
            self._exchange(peer, self.small)   # lazy connection set-up; both partners start together
        smalls = [self._both_ways(peer, self.small) for _ in range(repeats)]
        small, small_wall = (statistics.median(column) for column in zip(*smalls))
        big = medium = full = batched_medium = batched_full = large_wall = nan
        if large:
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                mine, _ = self._both_ways(peer, self.large)
                samples.append((mine, self._exchange(peer, self.medium), self._exchange(peer, self.large),
                                time.perf_counter() - start))
            big, medium, full, large_wall = (statistics.median(column) for column in zip(*samples))
            if self.device.type != "cuda":      # NCCL runs a batch as one group: the order is moot
                start = time.perf_counter()
                batched_medium = self._batched(peer, self.medium, repeats)
                batched_full = self._batched(peer, self.large, repeats)
                large_wall += (time.perf_counter() - start) / repeats
        values = dict(small_s=small, large_s=big, exchange_medium_s=medium, exchange_large_s=full,
                      batched_medium_s=batched_medium, batched_large_s=batched_full, small_wall_s=small_wall,
                      large_wall_s=large_wall)
        return PairTimes(**{k: np.array([v]) for k, v in values.items()})

    def measure_all_to_all(self, peers: np.ndarray, *, nbytes: int) -> np.ndarray:
        mine = [self._global(int(p)) for p in peers[0] if p >= 0]
        if not mine:
            return np.array([float("nan")])
        rows = len(mine) * nbytes
        send, recv = (buf[:rows].view(len(mine), nbytes) for buf in self.large)
        return np.array([all_to_all(self.group, self.device, mine, send, recv, self.timeout)])
