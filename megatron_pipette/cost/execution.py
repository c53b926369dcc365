"""What running a layer costs beyond its kernels' own work: constants with a physical reading.

The roofline and the measured kernel tables price each kernel alone, on an otherwise idle GPU. A
training step differs in three ways, each priced by one named constant here (their values,
the data they were fitted on and their physical bounds: docs/time-model.md, "Execution constants";
benchmarks/calibration/fit_execution.py refits them on the development set of published H100 runs only):

- Its GEMMs take longer than the tables say, by a share fitted on published runs and not yet
  attributed (GPU.step_gemm_fraction in data/gpus.json, per GPU). It was first read as the clock
  settling under the power limit; a GPU run showed the tables already hold that clock (an
  8192^3 GEMM held 60 s on an H200: 0.995 of its table price).
- A collective that overlaps compute is not free: NCCL's kernels hold SMs (one CTA per channel)
  and move its bytes through HBM while the GEMMs beside them run, so the compute stretches by a
  share of the time the collective runs hidden (`nccl_compute_share`).
- An MoE layer does more than its priced kernels: the token dispatcher's preprocessing (the
  routing map, the token counts' all-gather and the probabilities' all-to-all beside the tokens',
  each a small collective paid in latency), the dropless dispatcher's wait on the host (the counts
  copied to the CPU to size the all-to-all, after which the GPU idles until the host relaunches
  the layer's kernels), and the launch latency of a layer of many small kernels (per-expert
  quantisation and GEMMs, router, permutations): one fixed cost per MoE layer, micro-batch and
  direction (`moe_layer_fixed_s`), none where CUDA graphs capture the whole layer
  (cost.launch.moe_layer_graphed: no host wait, no launches).

Only the first corrects a price, so it applies to what the roofline prices and never to a layer
profile's measured seconds (cost.compute.measured_rate). The other two price what no profile times:
the profiler runs one-rank groups, with no collective beside its GEMMs, and profiles no MoE layer.
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
    moe_layer_fixed_s: float = 0.0
    """Seconds per MoE layer, micro-batch and direction beyond its priced kernels and dispatch.
    Physical bounds: three or four small collectives at NCCL's 20-50 us latency each, a host round
    trip (10-50 us), and up to a hundred kernel launches at 5-10 us not hidden behind the GPU's work:
    0.1-2 ms."""


DEFAULT_EXECUTION = Execution(nccl_compute_share=0.10, moe_layer_fixed_s=1.6e-3)
"""Fitted on the development set of published H100 runs only (benchmarks/calibration/fit_execution.py; raw
output benchmarks/results/fit_execution-2026-11-26-ep-overlap): the share at the low end of its physical range,
which decided it (docs/time-model.md), the MoE fixed cost in its upper half."""
