"""CPU rehearsal mode: run megatron.training's real `pretrain()` on CPU with gloo.

A layout meant for GPUs can be rehearsed end to end (process groups, pipeline and
interleaved schedules, DDP buckets, the distributed optimizer, checkpoints) on a machine
without one. megatron-core 0.19.2 assumes CUDA in a small, known set of places;
`enable_cpu_rehearsal()` redirects exactly those to the CPU. docs/cpu-rehearsal.md lists
them with the call sites that need them.

Call it before `pretrain()`/`initialize_megatron()`, ideally before megatron is imported.
Launch with `--distributed-backend gloo`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

from megatron_pipette.integration.options import REHEARSAL_ENV_VAR as ENV_VAR
from megatron_pipette.integration.options import env_switch
from megatron_pipette.units import GiB

_CPU = torch.device("cpu")
# What the rehearsal reports as "the GPU": Megatron's argument checks for Hopper apply.
_PRETEND_GPU = SimpleNamespace(
    name="CPU rehearsal (as sm_90)", major=9, minor=0, total_memory=80 * GiB,
    multi_processor_count=132,
)
# Stands in for the CUDA default generator: nothing draws from it on CPU, but Megatron saves
# and restores "the CUDA RNG state" (rerun state machine, checkpoints).
_STANDIN_CUDA_GENERATOR = torch.Generator()
# Megatron compares type names to pick optimizer/grad-clipping paths; CPU tensors answer these.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_enabled = False


def rehearsal_requested() -> bool:
    """True when PIPETTE_CPU_REHEARSAL is on (1, true, yes, on; options.env_switch, which refuses other
    words) or no CUDA device is usable."""
    return not torch.cuda.is_available() or env_switch(ENV_VAR)


def enable_cpu_rehearsal() -> None:
    """Redirect megatron-core's CUDA assumptions to the CPU, once per process."""
    global _enabled
    if _enabled:
        return
    _enabled = True
    # Processes Megatron starts itself (checkpoint workers) rehearse too.
    os.environ[ENV_VAR] = "1"
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_megatron_training()
    _patch_distributed_optimizer_load()
    _patch_moe_dispatcher()
    # Pushed for the life of the process: Megatron creates tensors on "cuda" from many
    # call sites (schedules, p2p buffers, optimizer, grad clipping, logging).
    _CudaToCpuMode().__enter__()


def is_enabled() -> bool:
    """Whether `enable_cpu_rehearsal()` has run in this process."""
    return _enabled


def _patch_torch_cuda() -> None:
    # Megatron's jit_fuser is torch.compile: building C++ kernels for each fused op costs
    # tens of seconds on CPU and teaches a rehearsal nothing. Run them eagerly.
    torch.compiler.set_stance("force_eager")
    cuda = torch.cuda
    # (Each patch is its own function object: dynamo indexes torch.* functions by identity.)
    # "The current GPU" is the host; initialize_megatron sets it, factories and .cuda() use it.
    cuda.set_device = _set_device
    cuda.current_device = _current_device
    # initialize_megatron builds model-parallel groups and seeds the RNG tracker only if > 0.
    cuda.device_count = _device_count
    # DDP wrapping and the p2p/timer code order GPU streams; CPU work is already ordered.
    cuda.Stream = _CpuStream
    cuda.current_stream = _current_stream
    cuda.stream = _stream
    cuda.synchronize = _synchronize
    # JIT warm-up and checkpointing free the caching allocator; report_memory reads it.
    cuda.empty_cache = _empty_cache
    cuda.memory_allocated = _no_bytes
    cuda.max_memory_allocated = _no_bytes
    cuda.memory_reserved = _no_bytes
    cuda.max_memory_reserved = _no_bytes
    # Rerun state machine and checkpoints save/restore it; model_parallel_cuda_manual_seed seeds it.
    cuda.get_rng_state = _get_rng_state
    cuda.set_rng_state = _set_rng_state
    cuda.manual_seed = _manual_seed
    # validate_args branches on the GPU generation (get_device_arch_version).
    cuda.get_device_properties = _device_properties


class _CpuStream(torch.cpu.Stream):
    """torch.cpu.Stream, except that record_event returns an event as CUDA's does: the MoE
    all-to-all dispatcher records one on its device-to-host stream and synchronises on it."""

    def record_event(self, event: torch.cpu.Event | None = None) -> torch.cpu.Event:
        event = event or torch.cpu.Event()
        event.record(self)
        return event


def _set_device(device: Any) -> None:
    return None


def _current_device() -> int:
    return 0


def _device_count() -> int:
    return 1


def _current_stream(device: Any = None) -> torch.cpu.Stream:
    return torch.cpu.current_stream()


def _stream(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return torch.cpu.stream(stream)


def _synchronize(device: Any = None) -> None:
    return None


def _empty_cache() -> None:
    return None


def _no_bytes(device: Any = None) -> int:
    return 0


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return _STANDIN_CUDA_GENERATOR.get_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    _STANDIN_CUDA_GENERATOR.set_state(new_state)


def _manual_seed(seed: int) -> None:
    _STANDIN_CUDA_GENERATOR.manual_seed(seed)


def _device_properties(device: Any = None) -> SimpleNamespace:
    return _PRETEND_GPU


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as tp_random

    class CpuRNGStatesTracker(tp_random.CudaRNGStatesTracker):  # type: ignore[misc]
        """Megatron's tracker over the CPU default generator, which CPU dropout and init draw from."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    # The tracker forks the CUDA generator per TP rank (weight init, dropout in TP regions);
    # on CPU those draws come from the CPU generator, so fork that one.
    tp_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    # Activation recomputation (CheckpointFunction, CheckpointWithoutOutput) saves and restores
    # the "CUDA" generator around the recomputed forward through these two.
    tp_random._get_cuda_rng_state = _get_cuda_rng_state
    tp_random._set_cuda_rng_state = _set_cuda_rng_state


def _get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return _get_rng_state()


def _set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    _set_rng_state(new_state)


def _patch_megatron_training() -> None:
    from megatron.training import initialize, training

    # pretrain() asserts torch.cuda.is_available() unless told that CPU is intended.
    training.initialize_megatron = functools.partial(
        initialize.initialize_megatron, allow_no_cuda=True
    )


def _patch_moe_dispatcher() -> None:
    """The all-to-all dispatcher moves its split sizes to the host as numpy arrays, which
    all_to_all_single takes; its helper converts only tensors on a GPU, so on CPU they stayed
    tensors, which the collective refuses. Convert them here too."""
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _host_tensor


def _host_tensor(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _patch_distributed_optimizer_load() -> None:
    """Fix two 0.19.2 bugs on the torch-Adam fallback path that CPU (no Apex/TE) always takes.

    Neither is a CUDA redirect; both only show when a distributed-optimizer checkpoint is loaded.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    optimizer_cls = distrib_optimizer.DistributedOptimizer
    state_dict = optimizer_cls.state_dict
    set_states = optimizer_cls._set_main_param_and_optimizer_states

    # state_dict() reads 'step' from per-parameter state, which a fresh optimizer that is
    # about to load a checkpoint has not allocated yet (it asserts on the empty set).
    @functools.wraps(state_dict)
    def state_dict_before_first_step(self: Any) -> dict[str, Any]:
        if self.optimizer.state:
            return state_dict(self)
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                self.optimizer.state[param]["step"] = torch.tensor(0.0)
        try:
            return state_dict(self)
        finally:
            self.optimizer.state.clear()

    # The fully-reshardable loader restores 'step' from the param groups and passes no
    # 'step' tensor, yet the copy loop indexes one for every tensor in torch Adam's state.
    @functools.wraps(set_states)
    def set_states_without_step(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        set_states(self, model_param, {"step": None, **tensors})

    optimizer_cls.state_dict = state_dict_before_first_step
    optimizer_cls._set_main_param_and_optimizer_states = set_states_without_step


def _to_cpu(device: Any) -> Any:
    """The CPU for a CUDA device (name, index or torch.device); anything else unchanged."""
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Puts Megatron's CUDA tensors on the CPU.

    Rewrites `device="cuda"`/`device=<index>` in tensor factories, makes `Tensor.cuda()`
    the identity (model placement in get_model, batches in forward_step), and answers
    `Tensor.type()` with the CUDA type name that the optimizer and grad clipping check.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _to_cpu(kwargs["device"])}
        return func(*args, **kwargs)
