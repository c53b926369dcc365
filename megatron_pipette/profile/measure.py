"""Timing forward/backward and counting the activations a micro-batch keeps for backward.

Activation memory is counted with `torch.autograd.graph.saved_tensors_hooks`: every
tensor autograd saves for backward passes through the pack hook, and the bytes of
the distinct storages behind them (parameters and shared inputs such as the mask
excluded) are what a micro-batch holds from its forward to its backward. This works
the same on CPU and GPU, does not depend on the caching allocator, and counts
storage once however many views of it are saved (Q, K and V are views of one QKV
output). Only what the graph still holds when forward ends counts: tensors packed
under no_grad and dropped at once (full recompute's first forward) do not. It misses tensors a
custom autograd function keeps as plain ctx
attributes instead of `save_for_backward` (megatron keeps only RNG states and
shapes that way). On a GPU the allocator's view is recorded next to it as a
cross-check: the `memory_allocated` growth across forward with the graph alive
(minus the output) and the forward's peak growth (`max_memory_allocated`,
which also holds transient workspaces).

Each saved tensor is attributed to the innermost module running when it was saved,
so the profiler can tell which bytes sequence parallelism would shard. The self-check's
CPU rehearsal counts the same way across a whole pipeline schedule (LiveSavedBytes: the most
held at once) and the tensors alive between steps (live_tensor_bytes: the model state).

Times are wall-clock medians over `iters` iterations after `warmup`: perf_counter
on CPU, CUDA events (synchronised after each iteration) on GPU. On a GPU a call that starts
after a synchronisation finds the GPU idle, waiting for the host to launch its first kernels;
in a stack of layers the host runs ahead and no layer but the first waits. So a layer is timed
as chains of two and of four calls, and half their difference is its time: both chains start the
same way, so the difference holds no start (benchmarks/results/h200-2026-11-28-layer-chain: alone
a 1.3B GPT layer took x1.83 of that at micro-batch 1, x1.11 at 2, x1.02 at 4 and 8; one call
alone against a chain of two is no better, the start of a call alone varies). On the CPU every
call runs synchronously, a stack's included, so a layer is timed alone.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from megatron_pipette.profile.build import Step


@dataclass
class SavedBytes:
    """What one forward pass saved for backward."""

    total: int = 0
    by_module: dict[str, int] = field(default_factory=dict)
    """Bytes per innermost module name ("" is the root module)."""

    def in_modules(self, names: frozenset[str]) -> int:
        return sum(v for k, v in self.by_module.items() if k in names)


@contextlib.contextmanager
def count_saved_tensors(root: torch.nn.Module, exclude: tuple[torch.Tensor, ...] = ()) -> Iterator[SavedBytes]:
    """Count distinct storages autograd saves inside the block and still holds at its end.

    The pack hook wraps each saved tensor in a holder that only the graph references;
    holders that died by the end (custom autograd functions called under no_grad, as
    in full recompute's first forward, pack what they save but keep no graph) are not
    activations. The result is filled in when the block exits, with the graph alive.
    """
    excluded = storage_keys((*root.parameters(), *root.buffers(), *exclude))
    held: list[weakref.ref[_Held]] = []
    stack: list[str] = []
    result = SavedBytes()

    def pack(t: torch.Tensor) -> _Held:
        holder = _Held(t, stack[-1] if stack else "")
        held.append(weakref.ref(holder))
        return holder

    def enter(name: str) -> None:
        stack.append(name)

    def leave() -> None:  # a forward hook's return value would replace the module's output
        stack.pop()

    handles = []
    for name, module in root.named_modules():
        handles.append(module.register_forward_pre_hook(lambda _m, _a, n=name: enter(n)))
        handles.append(module.register_forward_hook(lambda _m, _a, _o: leave()))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield result
    finally:
        for h in handles:
            h.remove()
    # Holders of graphs that were never kept (no_grad) are gone by now: refcounting
    # frees them when the function returns, no garbage collection needed.
    seen: set[tuple[int, int]] = set()
    for ref in held:
        holder = ref()
        if holder is None:
            continue
        key = _storage_key(holder.tensor)
        if key in excluded or key in seen:
            continue
        seen.add(key)
        nbytes = _storage_bytes(holder.tensor)
        result.total += nbytes
        result.by_module[holder.module] = result.by_module.get(holder.module, 0) + nbytes


class LiveSavedBytes:
    """Bytes autograd holds for backward at each moment across many forwards and backwards (a
    pipeline schedule's micro-batches), and the most held at once. Each saved tensor reaches the
    graph in a holder; when the graph lets the holder go (after the backward that used it, or with
    the graph) its storage's bytes are returned once no other holder of that storage is left.
    Storages in `excluded` (parameters, buffers) do not count. Use `hooks()` around forwards."""

    def __init__(self, excluded: set[tuple[int, int]]) -> None:
        self.excluded = excluded
        self.holders: dict[tuple[int, int], int] = {}
        self.live = self.peak = 0

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> _Held | torch.Tensor:
        key = _storage_key(t)
        if key in self.excluded:
            return t
        nbytes = _storage_bytes(t)
        if not self.holders.get(key):
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.holders[key] = self.holders.get(key, 0) + 1
        holder = _Held(t, "")
        weakref.finalize(holder, self._release, key, nbytes)
        return holder

    def _release(self, key: tuple[int, int], nbytes: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            self.live -= nbytes


def _unpack(packed: _Held | torch.Tensor) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Held) else packed


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[tuple[int, int]]:
    """The storages behind `tensors` (LiveSavedBytes' `excluded`)."""
    return {_storage_key(t) for t in tensors}


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor alive in this process, as the garbage
    collector sees them (tensors take part in its tracking). Tested by type(), not isinstance():
    the collector also lists weakref proxies, and isinstance() asks a dead one for its class."""
    sizes = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):
            sizes[_storage_key(obj)] = _storage_bytes(obj)
    return sum(sizes.values())


class _Held:
    """A saved tensor as the graph holds it, with the module that saved it."""

    __slots__ = ("tensor", "module", "__weakref__")

    def __init__(self, tensor: torch.Tensor, module: str) -> None:
        self.tensor = tensor
        self.module = module


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    try:
        return (t.untyped_storage().data_ptr(), 0)
    except (RuntimeError, NotImplementedError):  # tensor subclasses without one storage (FP8)
        return (id(t), 1)


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


@dataclass(frozen=True)
class Timing:
    forward_s: float
    backward_s: float
    iteration_s: float
    """One timed iteration's wall time, every chain length timed included (the profile's budget)."""


def activation_pass(step: Step, device: torch.device) -> tuple[SavedBytes, dict[str, int]]:
    """One untimed forward (counting saved tensors) and backward; GPU allocator deltas as extras."""
    extra: dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with count_saved_tensors(step.module, step.shared) as saved:
        out = step.forward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out_bytes = out.numel() * out.element_size()
        extra["allocator_activation_bytes"] = torch.cuda.memory_allocated(device) - before - out_bytes
        extra["forward_peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
    out.backward(step.output_grad(out))
    step.reset()
    del out
    return saved, extra


def time_step(step: Step, device: torch.device, warmup: int, iters: int) -> Timing:
    """Median forward and backward wall time of one call over `iters` after `warmup` iterations; on a
    GPU, of a part that chains, what a call adds inside a chain (the module docstring)."""
    if device.type != "cuda" or step.again is None:
        alone = _medians(step, device, warmup, iters, calls=1)
        return Timing(*alone, sum(alone))
    two, four = (_medians(step, device, warmup, iters, calls=n) for n in (2, 4))
    forward, backward = (call_in_chain(a, b) for a, b in zip(two, four, strict=True))
    return Timing(forward, backward, sum(two) + sum(four))


def call_in_chain(two: float, four: float) -> float:
    """One call's share of a chain from chains of two and four calls: (four - two) / 2, which holds no
    start; between nothing and half the chain of two (a start is never negative), and where noise
    puts it outside that, half the chain of two."""
    added = (four - two) / 2
    return added if 0 < added <= two / 2 else two / 2


def _medians(step: Step, device: torch.device, warmup: int, iters: int, calls: int) -> tuple[float, float]:
    forward, backward = [], []
    for i in range(warmup + iters):
        f, b = _cuda_iteration(step, device, calls) if device.type == "cuda" else _cpu_iteration(step)
        step.reset()
        if i >= warmup:
            forward.append(f)
            backward.append(b)
    return statistics.median(forward), statistics.median(backward)


def _cpu_iteration(step: Step) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = step.forward()
    t1 = time.perf_counter()
    out.backward(step.output_grad(out))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def _cuda_iteration(step: Step, device: torch.device, calls: int) -> tuple[float, float]:
    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    out = step.forward()
    for _ in range(calls - 1):
        out = step.again(out)
    mid.record()
    out.backward(step.output_grad(out))
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(mid) / 1e3, mid.elapsed_time(end) / 1e3
