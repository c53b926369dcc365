"""What running a layer costs beyond its kernels' own work: constants with a physical reading.

The roofline and the measured kernel tables price each kernel alone, on an idle GPU, in a short
burst. A training step differs in three ways, each priced by one named constant here (their values,
the data they were fitted on and their physical bounds: docs/time-model.md, "Execution constants";
benchmarks/fit_execution.py refits them on the development set of published H100 runs only):

- GEMMs run for minutes, not milliseconds: the GPU settles at the clock its power limit allows
  (GPU.sustained_gemm_fraction in data/gpus.json, per GPU, since it is a property of the part).
- A collective that overlaps compute is not free: NCCL's kernels hold SMs (one CTA per channel)
  and move its bytes through HBM while the GEMMs beside them run, so the compute stretches by a
  share of the time the collective runs hidden (`nccl_compute_share`).
- Megatron's all-to-all token dispatcher waits on the host once per MoE layer and direction
  (the token counts per expert are copied to the CPU to size the all-to-all), so the GPU idles
  while the host catches up and relaunches the layer's small kernels (`moe_layer_host_s`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Execution:
    """The execution constants of the time model (module docstring)."""

    nccl_compute_share: float = 0.0
    """Fraction of a GPU's compute throughput an overlapped NCCL collective takes while it runs.
    Physical bounds: NCCL's channels over the GPU's SMs (16-32 CTAs of an H100's 132 SMs: 0.12-0.24)
    plus its HBM traffic (a few percent): 0.1-0.3."""
    moe_layer_host_s: float = 0.0
    """Seconds the GPU idles per MoE layer, micro-batch and direction for the all-to-all dispatcher's
    host synchronisation. Physical bound: a CUDA sync and host round trip (10-50 us) plus the launch
    latency of the kernels up to the next one the GPU can run ahead of (10-40 kernels at 5-20 us
    each in eager PyTorch): 0.05-1 ms."""


DEFAULT_EXECUTION = Execution(nccl_compute_share=0.10, moe_layer_host_s=5e-5)
"""Fitted on the development set of published H100 runs only (benchmarks/fit_execution.py; raw
output benchmarks/results/fit_execution-2026-11-26): both at the low end of their physical range."""
