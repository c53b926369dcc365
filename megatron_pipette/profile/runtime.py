"""The process state megatron-core needs to run one layer on one device, set up and torn down.

megatron-core modules look up process groups, a global memory buffer and a CUDA
RNG tracker through module-level state. `single_device_megatron` creates what is
missing (a one-process gloo/nccl world, `initialize_model_parallel(1, 1)`, seeded
RNG tracker states) and removes exactly that on exit, so profiling inside a job
or a test leaves the caller's state as it found it. The layer is then built with
one-rank groups, so tensor-parallel collectives inside it are no-ops: the
profile measures compute only; the planner models TP communication from the
link matrix.

On a CPU (tests, laptops) three CUDA assumptions of megatron-core are redirected,
and torch.compile (megatron's `jit_fuser` for the fused bias-activation and
bias-dropout-add) runs eagerly, only inside the context:
  * the global memory buffer (unfused attention's score buffer) allocates on
    `torch.cuda.current_device()`: a CPU buffer replaces it;
  * the RNG tracker and activation checkpointing save and restore "the CUDA RNG
    state" (`tensor_parallel.random._get/_set_cuda_rng_state`): they save and
    restore a stand-in CPU generator instead. Dropout on CPU tensors draws from the
    CPU default generator either way, so no random stream changes meaning;
  * `model_parallel_cuda_manual_seed` queries the CUDA generator: the tracker's
    states are seeded from fresh CPU generators instead.
`megatron_pipette.integration.rehearsal.enable_cpu_rehearsal()` redirects more (for
a whole `pretrain()` run) but for the life of the process; the profiler needs
only these three and puts them back.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_pipette.errors import PipetteError

SEED = 1234


@dataclass(frozen=True)
class Environment:
    """What the profiler builds modules with."""

    device: torch.device
    pg_collection: Any
    """megatron.core.process_groups_config.ProcessGroupCollection of one-rank groups."""
    rank: int
    """This process's rank in the job's world (0 when the profiler made the world)."""


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`cuda`/`cpu`/None (CUDA when available) -> a concrete device, or one clear error."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise PipetteError(f"--device must be cuda or cpu, got {device!r}") from None
    if dev.type not in ("cuda", "cpu"):
        raise PipetteError(f"--device must be cuda or cpu, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise PipetteError("--device cuda: no CUDA device is available (use --device cpu)")
        if dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return dev


def device_record(device: torch.device, rank: int) -> dict:
    """The schema's "device" block: who was measured, so the planner can scale other devices."""
    if device.type == "cuda":
        name = torch.cuda.get_device_properties(device).name
    else:
        name = "cpu"
    return {"rank": rank, "host": socket.gethostname(), "device_name": name, "device_type": device.type,
            "platform": platform.machine(), "torch_threads": torch.get_num_threads()}


@contextlib.contextmanager
def single_device_megatron(device: torch.device) -> Iterator[Environment]:
    """Process groups, model-parallel state and RNG tracker for one-device profiling; restored on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with contextlib.ExitStack() as stack:
        # Seeding below must not change the caller's random streams.
        stack.enter_context(torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []))
        made_world = not dist.is_initialized()
        if made_world:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
            stack.callback(dist.destroy_process_group)
        rank = dist.get_rank()
        if not parallel_state.model_parallel_is_initialized():
            if dist.get_world_size() != 1:
                raise PipetteError("profile_layers: this process is one of several in a torch.distributed job "
                                   "that has not initialised Megatron's model-parallel groups; profile before "
                                   "torch.distributed starts, or after initialize_model_parallel")
            parallel_state.initialize_model_parallel(1, 1)
            stack.callback(parallel_state.destroy_model_parallel)
        pg_collection = stack.enter_context(_one_rank_groups())
        if device.type == "cpu":
            # Compiling the fused ops for the CPU takes longer than the whole profile.
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            stack.enter_context(_cpu_memory_buffer())
            stack.enter_context(_cpu_rng_state())
        stack.enter_context(_rng_tracker(device))
        torch.manual_seed(SEED)
        yield Environment(device=device, pg_collection=pg_collection, rank=rank)


@contextlib.contextmanager
def _one_rank_groups() -> Iterator[Any]:
    """Megatron's own groups when they already hold one rank each (standalone runs), else
    groups of this rank alone, so a profile taken inside a TP job builds TP-1 modules."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    mpu = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp", "tp_cp", "dp", "dp_cp",
                                                                      "mp", "embd", "pos_embd"])
    sizes = [g.size() for g in (mpu.tp, mpu.pp, mpu.cp) if g is not None]
    if all(s == 1 for s in sizes):
        yield mpu
        return
    own = dist.new_group(ranks=[dist.get_rank()], use_local_synchronization=True)
    pgs = ProcessGroupCollection()
    for name in ("tp", "pp", "cp", "tp_cp", "dp", "dp_cp", "mp", "embd", "pos_embd"):
        setattr(pgs, name, own)
    try:
        yield pgs
    finally:
        dist.destroy_process_group(own)


@contextlib.contextmanager
def _cpu_memory_buffer() -> Iterator[None]:
    from megatron.core import parallel_state

    saved = parallel_state._GLOBAL_MEMORY_BUFFER
    parallel_state._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()
    try:
        yield
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = saved


class _CpuMemoryBuffer:
    """megatron.core.utils.GlobalMemoryBuffer, allocating on the CPU."""

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(self, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None,
                   ) -> torch.Tensor:
        n = math.prod(tensor_shape)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
        return buf[:n].view(*tensor_shape)


@contextlib.contextmanager
def _cpu_rng_state() -> Iterator[None]:
    from megatron.core.tensor_parallel import random as tp_random

    standin = torch.Generator()
    saved = tp_random._get_cuda_rng_state, tp_random._set_cuda_rng_state

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return standin.get_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        standin.set_state(new_state)

    # The tracker warns when the CPU generator moves inside a fork; on CPU it always does
    # (dropout draws from it), so the warning says nothing here.
    tracker_log = logging.getLogger(tp_random.__name__)
    saved_level = tracker_log.level
    tp_random._get_cuda_rng_state, tp_random._set_cuda_rng_state = get_state, set_state
    tracker_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tp_random._get_cuda_rng_state, tp_random._set_cuda_rng_state = saved
        tracker_log.setLevel(saved_level)


@contextlib.contextmanager
def _rng_tracker(device: torch.device) -> Iterator[None]:
    """A freshly seeded tracker for the profile; the caller's tracker (a job's) is put back."""
    from megatron.core.tensor_parallel import random as tp_random

    saved = tp_random._CUDA_RNG_STATE_TRACKER, tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    tp_random.initialize_rng_tracker(force_reset=True)
    tracker = tp_random.get_cuda_rng_tracker()
    names = (tp_random._DATA_PARALLEL_RNG_TRACKER_NAME, tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
             tp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME)
    try:
        if device.type == "cuda":
            tp_random.model_parallel_cuda_manual_seed(SEED, tp_rank=0, ep_rank=0, etp_rank=0)
        else:
            for i, name in enumerate(names):
                tracker.states_[name] = torch.Generator().manual_seed(SEED + i).get_state()
                tracker.seeds_.add(SEED + i)
            tracker._is_initialized = True
        yield
    finally:
        tp_random._CUDA_RNG_STATE_TRACKER, tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved
