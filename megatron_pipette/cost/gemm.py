"""GEMM and attention-kernel efficiency, and the work units the cost model adds up.

A GEMM runs at a fraction of the device's large-GEMM rate (cluster.gemm_flops) that depends on
its shape: measured tables per GPU (data/gemm_efficiency.json, benchmarks/calibration/gemm_table.py), or a
parametric curve where a GPU has none. Work keeps effective FLOPs (FLOPs / efficiency) apart
from memory-bound seconds, so one array operation prices every device at its own GEMM speed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import NamedTuple

import numpy as np

from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.hardware import GPU
from megatron_pipette.spec.workload import BLOCK_SCALES, Workload, quantised_bytes

TABLE_DTYPES = {"bf16": "bf16", "fp16": "bf16", "fp32": "bf16", "fp8": "fp8"}
"""The measured dtype whose curve serves each training precision (fp16 runs bf16's tensor-core
rate; fp32 has no measurement and borrows bf16's shape dependence)."""


MAX_REMEMBERED_SHAPES = 100_000


@dataclass(frozen=True, eq=False)
class GemmCurve:
    """Fraction of the large-GEMM rate (cluster.gemm_flops, an 8192^3 GEMM) an (m x k) @ (k x n)
    GEMM attains: a measured table (data/gemm_efficiency.json, log efficiency on a log2 grid,
    interpolated trilinearly, clamped beyond it), or where the GPU has none the parametric
    prod over m, n, k of x / (x + half_dim), half_dim fitted on the H100 table's shapes. Never
    above the large GEMM's own rate, and never faster than HBM can feed it: a GEMM moves at least
    its two operands and its output once, so its time is at least those bytes over the memory
    bandwidth (the roofline floor; `ridge` turns it into an efficiency). Below the table's
    smallest dimension (2^lo, 128) a GEMM takes at least the time of the same GEMM at 2^lo on
    that axis, not the clamped rate's shorter time: tensor-core kernels compute whole tiles of
    64-256 rows and columns, so a smaller GEMM does about a tile's work. An H200 measured it
    (docs/validation.md, "Small K or M"): M 16 and 64 took the same 44 us against 8192 x 8192, K 64
    0.91 of K 128's time; the clamped rate had priced them 1.36-1.46x too fast."""

    log_table: np.ndarray | None
    """(g, g, g) log efficiency at m, n, k = 2^(lo + index); None: the parametric curve."""
    lo: int = 0
    """log2 of the grid's first node."""
    half_dim: float = 0.0
    """The parametric curve's constant (0: every GEMM at the large-GEMM rate)."""
    speedup: float = 1.0
    """The large GEMM's rate in this curve's dtype over the rate `cluster.gemm_flops` holds (FP8
    GEMMs priced against the training dtype's rate); 1 for the training dtype itself."""
    ridge: float = 0.0
    """FLOPs per byte of HBM traffic at which a GEMM at the training dtype's large-GEMM rate turns
    memory bound (that rate over the GPU's memory bandwidth); 0: no floor (no catalog GPU)."""
    operand_bytes: float = 2.0
    """Bytes per element of the two operands as the GEMM reads them (1 for FP8)."""
    output_bytes: float = 2.0
    """Bytes per output element written (a 16-bit result)."""
    _seen: dict = field(default_factory=dict, init=False, repr=False)
    """Efficiencies already looked up: a search prices the same few shapes for thousands of jobs.
    A memo of a pure function of the shape, kept as long as the curve (gemm_curve's module-level
    memo keeps one curve per GPU and precision for every cost model)."""

    def __call__(self, m: float, n: float, k: float, output_bytes: float | None = None) -> float:
        """`output_bytes`: per output element where the GEMM writes other than a 16-bit result (the
        weight gradient accumulated into an fp32 main_grad reads and writes 8 bytes)."""
        key = (m, n, k, output_bytes)
        hit = self._seen.get(key)
        if hit is None:
            if self.log_table is None:
                hit = float(np.prod([x / (x + self.half_dim) for x in (m, n, k)]))
            else:
                hit = _interpolate(self.log_table, self.lo, (m, n, k))
            hit = min(hit, 1.0) * self.speedup
            if self.ridge > 0:
                moved = self.operand_bytes * (m * k + k * n) + (output_bytes or self.output_bytes) * m * n
                hit = min(hit, 2.0 * m * n * k / moved / self.ridge)
            tile = 2.0 ** self.lo
            if self.log_table is not None and min(m, n, k) < tile:
                whole = tuple(max(x, tile) for x in (m, n, k))
                hit = min(hit, self(*whole, output_bytes) * m * n * k / float(np.prod(whole)))
            if len(self._seen) >= MAX_REMEMBERED_SHAPES:
                self._seen.clear()
            self._seen[key] = hit
        return hit


def _interpolate(log_table: np.ndarray, lo: int, coords) -> float:
    """exp of the multilinear interpolation of `log_table` (nodes at 2^(lo + index) on every axis)
    at log2 of `coords`, clamped to the grid."""
    g = log_table.shape[0]
    u = np.clip(np.log2(coords), lo, lo + g - 1) - lo
    i = np.minimum(u.astype(int), g - 2)
    cube = log_table[tuple(slice(k, k + 2) for k in i)]
    for w in u - i:                          # interpolate away the first axis, then the next
        cube = cube[0] * (1 - w) + cube[1] * w
    return float(np.exp(cube))


ATTENTION_KERNELS = {"auto": "cudnn", "fused": "cudnn", "flash": "flash"}
"""The measured kernel each --attention-backend runs: Transformer Engine's fused attention is cuDNN's
(also what auto picks on Hopper); flash is FlashAttention."""


@dataclass(frozen=True, eq=False)
class AttentionCurve:
    """Fraction of the large-GEMM rate a causal attention kernel attains, counting the FLOPs it does
    (half the full s^2 work), as a function of one call's FLOPs: measured forward and backward
    (data/gemm_efficiency.json, log efficiency on a log2 grid of FLOPs, interpolated linearly)."""

    log_table: np.ndarray
    """(2, g) log efficiency, [forward, backward], at 2^(lo + index) FLOPs."""
    lo: int

    def efficiency(self, direction: int, flops: float) -> float:
        """direction 0: forward, 1: backward."""
        return _interpolate(self.log_table[direction], self.lo, (flops,))


# Module-level memo (cost.model lists them): package data, read once per GPU and backend.
@cache
def attention_curve(gpu: GPU | None, attention_backend: str) -> AttentionCurve | None:
    """The causal kernel's measured curve on this GPU, None where there is none (unfused attention,
    or a GPU without an attention table)."""
    kernel = ATTENTION_KERNELS.get(attention_backend)
    entry = _gpu_entry(gpu)
    if kernel is None or entry is None or kernel not in entry.get("attention", {}):
        return None
    table = entry["attention"][kernel]
    return AttentionCurve(log_table=np.log(np.array([table["forward"], table["backward"]], dtype=float)),
                          lo=_gemm_data()["attention_log2_flops_range"][0])


# Module-level memo (cost.model lists them): package data, read once.
@cache
def _gemm_data() -> dict:
    return json.loads(resources.files("megatron_pipette.data").joinpath("gemm_efficiency.json").read_text())


def _gpu_entry(gpu: GPU | None) -> dict | None:
    """This GPU's measured tables (another GPU's where it stands in), None where none."""
    entry = _gemm_data()["gpus"].get(gpu.name) if gpu is not None else None
    return _gemm_data()["gpus"][entry["same_as"]] if entry is not None and "same_as" in entry else entry


# Module-level memo (cost.model lists them): package data, read once per GPU and precision.
@cache
def gemm_curve(gpu: GPU | None, precision: str) -> GemmCurve:
    """The GEMM efficiency curve of this GPU (None: no catalog GPU) at this training precision."""
    data, dtype, entry = _gemm_data(), TABLE_DTYPES[precision], _gpu_entry(gpu)
    ridge = (gpu.large_gemm_rate(precision) / gpu.attained_memory_bandwidth_Bps if gpu and precision in gpu.peak_flops
             else 0.0)
    width = 4.0 if precision == "fp32" else 2.0
    if entry is None or dtype not in entry["tables"]:
        return GemmCurve(log_table=None, half_dim=float(data["half_dim"][dtype]), ridge=ridge,
                         operand_bytes=width, output_bytes=width)
    return GemmCurve(log_table=np.log(np.array(entry["tables"][dtype], dtype=float)), lo=data["log2_range"][0],
                     ridge=ridge, operand_bytes=width, output_bytes=width)


# Module-level memo (cost.model lists them): package data, read once per GPU, precision and recipe.
@cache
def fp8_curve(gpu: GPU | None, precision: str, recipe: str = "delayed") -> GemmCurve:
    """FP8 and FP4 GEMMs (Transformer Engine's, under --fp8-format or --fp4-format) against the
    training dtype's large-GEMM rate: the fp8 table's efficiency by shape, times the large quantised
    GEMM's rate over the training dtype's (the catalog's peaks and large-GEMM efficiencies; the probe
    measures the training dtype's). A cluster of GPUs the catalog does not know is taken at twice
    the rate (Hopper's and Blackwell's dense FP8 over BF16 peak); NVFP4 needs a catalog GPU.
    MXFP8 GEMMs run at the dense FP8 peak (Blackwell's datasheets give one FP8 figure), NVFP4 ones
    at the dense FP4 peak, on the same curve (no FP4 table was measured), reading each operand's
    block scales besides its bytes. Both need Blackwell's block-scaled tensor cores (Transformer
    Engine: compute capability 10.0, quantization.py _compute_mxfp8_support and
    _compute_nvfp4_support), which the catalog marks by an fp4 peak."""
    dtype = QUANTISED_PEAKS.get(recipe, "fp8")
    speedup = 2.0
    if dtype == "fp4":
        if gpu is None or "fp4" not in gpu.peak_flops:
            name = gpu.name if gpu is not None else "a GPU outside the catalog"
            raise PipetteError(f"--fp4-format: {name} has no FP4 tensor cores in the catalog (no fp4 peak; Transformer "
                               "Engine runs NVFP4 on compute capability 10.0, Blackwell)")
    elif gpu is not None:
        if "fp8" not in gpu.peak_flops:
            raise PipetteError(f"--fp8-format: {gpu.name} has no FP8 tensor cores")
        if recipe in BLOCK_SCALES and "fp4" not in gpu.peak_flops:
            raise PipetteError(f"--fp8-recipe {recipe}: {gpu.name} has no block-scaled (MXFP8) tensor cores "
                               "(Transformer Engine runs MXFP8 on compute capability 10.0, Blackwell)")
    if gpu is not None:
        speedup = gpu.large_gemm_rate(dtype) / gpu.large_gemm_rate(precision)
    # Transformer Engine's quantised GEMMs read 1-byte (FP4: half-byte) operands and their block
    # scales, and write the 16-bit training dtype.
    fp8 = gemm_curve(gpu, "fp8")
    return dataclasses.replace(gemm_curve(gpu, precision), log_table=fp8.log_table, half_dim=fp8.half_dim,
                               speedup=speedup, operand_bytes=quantised_bytes(recipe))


QUANTISED_PEAKS = {"nvfp4": "fp4"}
"""The catalog peak (GPU.peak_flops key) each recipe's GEMMs run at where not fp8's."""

AMAX_PASSES = {"nvfp4": 1}
"""Reads of a tensor before it is quantised, where the recipe takes its scale from the tensor itself:
NVFP4's per-tensor amax of the Hadamard-transformed tensor (TE 2.20 csrc/quantizer.cpp,
NVFP4Quantizer::quantize_impl: nvte_hadamard_transform_amax, then the quantising kernel). Left at 0
for tensorwise, as the per-tensor FP8 prices have always been, and for MXFP8, whose scales come from
each block inside the quantising kernel."""


def fp8_cast_bytes_per_element(recipe: str) -> float:
    """Bytes moved quantising one 16-bit element of a linear's input or output gradient: the 16-bit
    value read (and read again for an amax first, AMAX_PASSES) and each copy written. Per-tensor
    recipes write one copy (3 bytes). The block-scaled ones write a rowwise and a columnwise copy,
    each with its own scales, from one read (TE 2.20, recipes MXFP8BlockScaling and
    NVFP4BlockScaling: both directions are quantised from the high-precision tensor; NVFP4's
    columnwise copy through the 16x16 Hadamard transform in the same kernel,
    nvte_quantize_with_hadamard_transform), because the forward GEMM and the backward's GEMMs scale
    along different axes (module/linear.py: the input's rowwise copy feeds the forward GEMM, its
    columnwise one the weight gradient; the output gradient's rowwise one the data gradient, its
    columnwise one the weight gradient): MXFP8 2 + 2 x 1.03125 bytes, NVFP4 2 + 2 + 2 x 0.5625."""
    copies = 2 if recipe in BLOCK_SCALES else 1
    return 2 * (1 + AMAX_PASSES.get(recipe, 0)) + copies * quantised_bytes(recipe)


def fp8_cast_bytes(recipe: str | None, gemms: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(forward, backward) bytes Transformer Engine moves casting FP8 GEMM operands, for linears given
    as (rows, out, in): each input in the forward, each output gradient in the backward (weights are
    cast once an iteration and kept). `recipe`: Workload.quantisation_recipe, None without FP8 or FP4."""
    if recipe is None:
        return 0.0, 0.0
    per_element = fp8_cast_bytes_per_element(recipe)
    return (per_element * sum(rows * inp for rows, _, inp in gemms),
            per_element * sum(rows * out for rows, out, _ in gemms))


def main_grad_bytes(workload: Workload) -> int:
    """Bytes a weight-gradient GEMM reads and writes per weight: gradient-accumulation fusion (on
    wherever Transformer Engine or Apex is, Megatron's default) adds it into the parameter's
    main_grad in place (TE's fuse_wgrad_accumulation: the GEMM's output is main_grad, beta = 1)."""
    return 2 * workload.grad_bytes


def gemm_work(gemm: GemmCurve, m: float, n: float, k: float, count: float = 1.0,
              output_bytes: float | None = None) -> float:
    """Effective FLOPs (FLOPs / efficiency) of `count` GEMMs of this shape; a batch of them runs
    as one GEMM of `count` times the rows (a batched matmul: one kernel)."""
    return 2.0 * m * n * k * count / gemm(m * count, n, k, output_bytes)


class LinearFlops(NamedTuple):
    """Effective FLOPs of the three GEMMs of a linear layer (or of several, summed)."""

    forward: float
    dgrad: float
    """The data gradient: the backward's input gradient."""
    wgrad: float
    """The weight gradient."""


def linear_work(gemm: GemmCurve, tokens: float, out: float, inp: float, main_grad_bytes: float | None = None,
                count: int = 1) -> LinearFlops:
    """(forward, data-gradient, weight-gradient) effective FLOPs of a linear layer [inp -> out] over
    `tokens`: tokens x inp @ inp x out, tokens x out @ out x inp, out x tokens @ tokens x inp, each
    at its own shape's efficiency. `main_grad_bytes`: what the weight-gradient GEMM reads and writes
    per weight where it accumulates into Megatron's main_grad (gradient-accumulation fusion: twice
    the gradient buffer's dtype); None: a 16-bit result. `count` such linears, each its own GEMM
    (a grouped GEMM of the local experts: every expert reads its own weights)."""
    return LinearFlops(forward=count * gemm_work(gemm, tokens, out, inp),
                       dgrad=count * gemm_work(gemm, tokens, inp, out),
                       wgrad=count * gemm_work(gemm, out, inp, tokens, output_bytes=main_grad_bytes))


@dataclass(frozen=True, kw_only=True)
class Work:
    """Work of one micro-batch on one device."""

    flops: float = 0.0
    """Effective GEMM FLOPs: seconds = flops / the device's gemm_flops."""
    mem_s: float = 0.0
    """Memory-bound seconds."""

    def __add__(self, other: Work) -> Work:
        return Work(flops=self.flops + other.flops, mem_s=self.mem_s + other.mem_s)

    def scaled(self, k: float) -> Work:
        return Work(flops=self.flops * k, mem_s=self.mem_s * k)

    def seconds(self, rate):
        """Seconds at `rate` GEMM FLOP/s (a number, or an array it broadcasts against)."""
        return self.flops / rate + self.mem_s


@dataclass(frozen=True, kw_only=True)
class PartWork:
    """Forward, backward and recomputed work of one part of the model."""

    forward: Work
    backward: Work
    """Without recomputation."""
    recompute: Work = Work()
    """Extra forward work redone in the backward, when this part is recomputed."""
    wgrad: Work = Work()
    """Of the backward, the weight-gradient GEMMs, where a schedule runs them apart (priced for the
    routed experts, whose wgrad --delay-wgrad-compute defers)."""
