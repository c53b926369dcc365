"""Timing on one GPU, shared by the calibration measurements and the validation checks: a GEMM as
Megatron calls it, a phase timer with CUDA events and the L2 flushed, the device's metadata.

Why one module: the planner's prices are checked (validation.cost_check) with the same timer and the
same GEMM operands its tables were measured with (calibration.gemm_efficiency), so a difference
between the two is the model's, not the stopwatch's.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_pipette.spec.hardware import gpu_catalog

FP8_MAX = 448.0
"""Largest float8_e4m3fn value: per-tensor scales map each operand's amax to it."""

@dataclass(frozen=True)
class Gemm:
    """One GEMM as Megatron calls it: C[m, n] = A[m, k] B[k, n], operands stored as `layout` says
    (N: as used, T: stored transposed)."""

    m: int
    n: int
    k: int
    layout: str
    dtype: str
    fast_accum: bool = False

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


class Timer:
    """Median device seconds of each phase of a step: CUDA events around each phase with the
    L2 cache flushed before each run; perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.flush = None
        if device.type == "cuda":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            self.flush = torch.empty(2 * l2, dtype=torch.uint8, device=device)

    def measure(self, step: Callable[[Callable[[], None]], object], phases: int = 1, min_reps: int = 5,
                target_s: float = 0.005, max_reps: int = 30) -> list[float]:
        """`step(mark)` runs once per repeat and calls mark() before, between and after its phases.
        The untimed warm-up's wall time (one-off costs included, so an over-estimate) sets the repeats."""
        t0 = time.perf_counter()
        step(lambda: None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        reps = max(min_reps, min(max_reps, int(target_s / (time.perf_counter() - t0))))
        runs = self._run(step, phases, reps)
        return [statistics.median(r[i] for r in runs) for i in range(phases)]

    def _run(self, step, phases: int, reps: int) -> list[list[float]]:
        cuda = self.device.type == "cuda"
        marks: list[list] = []
        for _ in range(reps):
            if cuda:
                self.flush.zero_()
            stamps: list = []

            def mark(stamps: list = stamps) -> None:
                if cuda:
                    e = torch.cuda.Event(enable_timing=True)
                    e.record()
                    stamps.append(e)
                else:
                    stamps.append(time.perf_counter())

            step(mark)
            marks.append(stamps)
        if cuda:
            torch.cuda.synchronize(self.device)
            return [[s[i].elapsed_time(s[i + 1]) / 1e3 for i in range(phases)] for s in marks]
        return [[s[i + 1] - s[i] for i in range(phases)] for s in marks]


def gemm_step(g: Gemm, device: torch.device) -> Callable[[Callable[[], None]], object]:
    """Random operands in the GEMM's layout and the step that runs it between two marks."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    if g.dtype == "fp8":
        def quantised(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            scale = (x.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
            return (x / scale).to(torch.float8_e4m3fn), scale

        a, sa = quantised(rand(g.m, g.k))
        bt, sb = quantised(rand(g.n, g.k))
        b = bt.t()

        def run() -> torch.Tensor:
            return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=g.fast_accum)
    else:
        a = rand(g.m, g.k) if g.layout[0] == "N" else rand(g.k, g.m).t()
        b = rand(g.k, g.n) if g.layout[1] == "N" else rand(g.n, g.k).t()

        def run() -> torch.Tensor:
            return torch.matmul(a, b)

    def step(mark: Callable[[], None]) -> None:
        mark()
        run()
        mark()

    return step


NVIDIA_SMI_QUERY = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu"


def nvidia_smi(query: str = NVIDIA_SMI_QUERY) -> str | None:
    """Clocks, power and temperature as the driver reports them, CSV with a header (None where
    unreadable, or where the driver knows no field of `query`)."""
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def device_metadata(device: torch.device) -> dict:
    """Who measured: device, versions, clocks, date; the catalog peaks the efficiencies divide by."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    gpu = gpu_catalog().get(name.lower())
    return {"device_name": name, "device_type": device.type, "catalog_gpu": gpu.name if gpu else None,
            "peak_flops": dict(gpu.peak_flops) if gpu else {}, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
            "python": platform.python_version(), "host": platform.node(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "nvidia_smi_before": nvidia_smi() if device.type == "cuda" else None}


def write_json(path: Path, doc: dict) -> None:
    """Whole-file replace, so a run killed mid-write still leaves the last complete document."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def sig(x: float) -> float:
    """Four significant digits: what timing noise leaves meaningful."""
    return float(f"{x:.4g}")
