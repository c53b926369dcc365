"""Per-device compute and memory checks: a GEMM rate and a copy bandwidth.

Why: one slow device (throttled clocks, a bad HBM stack, a busy neighbour on
a shared CPU) slows every pipeline stage it sits in; the planner needs the
rate each device attains, not the datasheet's. Both checks run for a fixed
wall-clock window on all ranks at once (started by a barrier), so a device
that attains less while everyone works completes fewer iterations and shows
up as slower, and the time spent is known in advance for the budget.
"""

from __future__ import annotations

import time

import torch

from megatron_pipette.units import MiB

# GEMM edge per device kind and dtype: big enough to reach the device's
# steady-state rate, small enough for a short window (an 8192^3 bf16 GEMM is
# ~1.4 ms on an H100; a 512^3 fp32 GEMM is a few ms on one CPU core).
GEMM_N_CUDA = {torch.bfloat16: 8192, torch.float16: 8192, torch.float32: 4096}
GEMM_N_CPU = 512
COPY_BYTES_CUDA = 512 * MiB
COPY_BYTES_CPU = 32 * MiB

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def gemm_precision(precision: str, device: torch.device) -> tuple[str, str | None]:
    """The precision the GEMM check can run at for the requested one, and why it differs.

    CPUs are checked in fp32 (the rehearsal's precision; CPU bf16 GEMMs are
    emulated and say nothing about a GPU). fp8 needs scaled-matmul plumbing
    that is not worth a probe; its bf16 rate is recorded instead.
    """
    if device.type != "cuda":
        return "fp32", None if precision == "fp32" else f"CPU devices are checked in fp32, not {precision}"
    if precision == "fp8":
        return "bf16", "fp8 GEMM not timed; the bf16 rate is recorded"
    return precision, None


def _window(step, window_s: float, device: torch.device) -> tuple[int, float]:
    """Run `step` until `window_s` has passed; return (iterations, seconds)."""
    count = 0
    start = time.perf_counter()
    while True:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= window_s:
            return count, elapsed


def prepare_gemm(device: torch.device, precision: str):
    """Allocate and warm up the GEMM operands (kernel selection, page faults); returns the step."""
    dtype = _DTYPES[precision]
    n = GEMM_N_CUDA[dtype] if device.type == "cuda" else GEMM_N_CPU
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)

    def step() -> None:
        torch.matmul(a, b, out=c)

    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return step, 2.0 * n**3, n


def gemm_rate(step, flops_per_step: float, window_s: float, device: torch.device) -> float:
    """Attained FLOP/s of the prepared GEMM over the window."""
    count, elapsed = _window(step, window_s, device)
    return count * flops_per_step / elapsed


def prepare_copy(device: torch.device):
    """Allocate and touch the copy buffers; returns the step and the bytes it moves (read + write)."""
    nbytes = COPY_BYTES_CUDA if device.type == "cuda" else COPY_BYTES_CPU
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def step() -> None:
        dst.copy_(src)

    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return step, 2.0 * src.numel() * 4


def copy_bandwidth(step, bytes_per_step: float, window_s: float, device: torch.device) -> float:
    """Attained memory bandwidth (bytes read + written per second) over the window."""
    count, elapsed = _window(step, window_s, device)
    return count * bytes_per_step / elapsed
