"""Compute time of one micro-batch, per pipeline stage and model chunk.

Work is kept in two parts so one array operation prices every tensor-parallel
group at its own speed: `flops` (effective GEMM FLOPs, already divided by the
shape's GEMM efficiency) run at the group's slowest device's `gemm_flops` (the
rate of a large, 8192^3 GEMM); `mem_s` (memory-bound operations, bytes / memory
bandwidth) does not scale with GEMM speed. A LayerProfile replaces the roofline:
its times become flops = time * the rate the profiled device had while profiled
(alone), and scale with each group's probed rate (every device loaded at once).

Roofline per transformer layer, per TP rank (b micro-batch, s sequence, h
hidden, a heads, g query groups, d head dim, f ffn, t TP):
  forward GEMM FLOPs  2bs h(a+2g)d/t  (QKV)  + 4b s^2 a d/t (scores, AV; half
                      with causal flash/fused kernels, which skip the masked half,
                      at their measured rate where there is one) + 2bs a d h/t (proj)
                      + 2bs h f (2 or 3 with SwiGLU)/t (MLP)
  backward            each linear's data- and weight-gradient GEMMs (2x the
                      forward FLOPs, at their own shapes' efficiency)
  memory-bound        norms, bias-dropout-add, activation, RoPE, and the
                      softmax/dropout of the score matrix without flash
                      attention (bytes moved, docs/time-model.md); backward 2x
Recomputation adds forward work to the backward: full, the whole layer for
each recomputed layer (uniform: all, block n: n per model chunk); selective,
the attention core.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np

from megatron_pipette.spec.hardware import GPU, Cluster
from megatron_pipette.spec.job import Job
from megatron_pipette.spec.layer_profile import LayerProfile
from megatron_pipette.spec.layout import Layout

FLASH_BACKENDS = ("auto", "flash", "fused")
"""Attention backends that keep no s*s score matrix (no softmax/dropout memory traffic) and whose
causal kernels skip the masked half of the scores."""
BACKWARD_MEMORY_FACTOR = 2.0
"""Backward of an elementwise op reads the saved input and the incoming gradient and writes one."""


TABLE_DTYPES = {"bf16": "bf16", "fp16": "bf16", "fp32": "bf16", "fp8": "fp8"}
"""The measured dtype whose curve serves each training precision (fp16 runs bf16's tensor-core
rate; fp32 has no measurement and borrows bf16's shape dependence)."""


@dataclass(frozen=True, eq=False)
class GemmCurve:
    """Fraction of the large-GEMM rate (cluster.gemm_flops, an 8192^3 GEMM) an (m x k) @ (k x n)
    GEMM attains: a measured table (data/gemm_efficiency.json, log efficiency on a log2 grid,
    interpolated trilinearly, clamped beyond it), or where the GPU has none the parametric
    prod over m, n, k of x / (x + half_dim), half_dim fitted on the H100 table's shapes."""

    log_table: np.ndarray | None
    """(g, g, g) log efficiency at m, n, k = 2^(lo + index); None: the parametric curve."""
    lo: int = 0
    """log2 of the grid's first node."""
    half_dim: float = 0.0
    """The parametric curve's constant (0: every GEMM at the large-GEMM rate)."""

    def __call__(self, m: float, n: float, k: float) -> float:
        if self.log_table is None:
            return float(np.prod([x / (x + self.half_dim) for x in (m, n, k)]))
        return _interpolate(self.log_table, self.lo, (m, n, k))


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


@cache
def _gemm_data() -> dict:
    return json.loads(resources.files("megatron_pipette.data").joinpath("gemm_efficiency.json").read_text())


def _gpu_entry(gpu: GPU | None) -> dict | None:
    """This GPU's measured tables (another GPU's where it stands in), None where none."""
    entry = _gemm_data()["gpus"].get(gpu.name) if gpu is not None else None
    return _gemm_data()["gpus"][entry["same_as"]] if entry is not None and "same_as" in entry else entry


@cache
def gemm_curve(gpu: GPU | None, precision: str) -> GemmCurve:
    """The GEMM efficiency curve of this GPU (None: no catalog GPU) at this training precision."""
    data, dtype, entry = _gemm_data(), TABLE_DTYPES[precision], _gpu_entry(gpu)
    if entry is None or dtype not in entry["tables"]:
        return GemmCurve(log_table=None, half_dim=float(data["half_dim"][dtype]))
    return GemmCurve(log_table=np.log(np.array(entry["tables"][dtype], dtype=float)), lo=data["log2_range"][0])


def _gemm(gemm: GemmCurve, m: float, n: float, k: float, count: float = 1.0) -> float:
    """Effective FLOPs (FLOPs / efficiency) of `count` GEMMs of this shape; a batch of them runs
    as one GEMM of `count` times the rows."""
    return 2.0 * m * n * k * count / gemm(m * count, n, k)


def _linear(gemm: GemmCurve, tokens: float, out: float, inp: float) -> tuple[float, float, float]:
    """(forward, data-gradient, weight-gradient) effective FLOPs of a linear layer [inp -> out] over
    `tokens`: tokens x inp @ inp x out, tokens x out @ out x inp, out x tokens @ tokens x inp, each
    at its own shape's efficiency."""
    return _gemm(gemm, tokens, out, inp), _gemm(gemm, tokens, inp, out), _gemm(gemm, out, inp, tokens)


def _layer_linears(job: Job) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear of a transformer layer on one TP rank."""
    x, swiglu = _shape(job), job.workload.swiglu
    a, g, d, f, h = x["a"], x["g"], x["d"], x["f"], x["h"]
    return {"qkv": ((a + 2 * g) * d, h), "proj": (h, a * d), "fc1": (f * (2 if swiglu else 1), h), "fc2": (h, f)}


COLUMN_PARALLEL = ("qkv", "fc1")
"""The layer's column-parallel linears: Megatron overlaps their backward TP collectives with their
own gradient GEMMs (cost.timing)."""


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


@dataclass(frozen=True, kw_only=True)
class PartWork:
    """Forward, backward and recomputed work of one part of the model."""

    forward: Work
    backward: Work
    """Without recomputation."""
    recompute: Work = Work()
    """Extra forward work redone in the backward, when this part is recomputed."""


def _shape(job: Job) -> dict:
    w, layout = job.workload, job.layout
    t = layout.tp
    return dict(n=layout.micro_batch_size * w.seq_length, b=layout.micro_batch_size, s=w.seq_length,
                h=w.hidden_size, a=w.num_attention_heads // t, g=w.query_groups // t, d=w.head_dim,
                f=w.ffn // t, e=w.bytes_per_element, sp=layout.tp if layout.sequence_parallel else 1)


def core_attention(gemm: GemmCurve, attention: AttentionCurve | None, causal_kernel: bool, b: int, a: int,
                   s: int, d: int) -> tuple[float, float]:
    """(forward, backward) effective FLOPs of the attention core (scores and weighted values) of b
    sequences of a heads on one TP rank. Unfused attention multiplies the full s x s scores and
    masks them; causal flash/fused kernels skip the masked half: half the FLOPs, at the kernel's
    measured rate where there is one (`attention`), else at the GEMM curve's."""
    full = _gemm(gemm, s, s, d, b * a) + _gemm(gemm, s, d, s, b * a)
    if not causal_kernel:
        return full, 2 * full
    if attention is None:
        return full / 2, full
    flops = 2.0 * b * a * s * s * d
    return flops / attention.efficiency(0, flops), 2 * flops / attention.efficiency(1, 2 * flops)


def roofline_layer(job: Job, memory_bandwidth_Bps: float, gemm: GemmCurve | None = None,
                   attention: AttentionCurve | None = None) -> PartWork:
    """One transformer layer on one TP rank; `gemm` None: the parametric curve (no GPU named);
    `attention`: the causal kernel's measured curve, where the GPU has one."""
    w, layout, x = job.workload, job.layout, _shape(job)
    n, b, s, h, a, g, d, f, e, sp = (x[k] for k in "n b s h a g d f e sp".split())
    gemm = gemm or gemm_curve(None, w.precision)
    core, core_backward = core_attention(gemm, attention, w.attention_backend in FLASH_BACKENDS, b, a, s, d)
    linears = [_linear(gemm, n, out, inp) for out, inp in _layer_linears(job).values()]
    drop = 1 if w.hidden_dropout > 0 else 0
    hidden = (2 * 2 * e + 2 * (3 * e + drop)) * n * h / sp          # two norms, two bias-dropout-adds
    act = (3 if w.swiglu else 2) * e * n * f
    rope = 2 * e * n * (a + g) * d if w.position_embedding_type == "rope" else 0
    scores = 0.0
    if w.attention_backend not in FLASH_BACKENDS:
        scores = (2 * e + (2 * e + 1 if w.attention_dropout > 0 else 0)) * b * a * s * s
    mem = (hidden + act + rope + scores) / memory_bandwidth_Bps
    forward = Work(flops=core + sum(fwd for fwd, _, _ in linears), mem_s=mem)
    backward = Work(flops=core_backward + sum(dgrad + wgrad for _, dgrad, wgrad in linears),
                    mem_s=BACKWARD_MEMORY_FACTOR * mem)
    if layout.recompute_granularity == "full":
        recompute = forward
    elif layout.recompute_granularity == "selective":
        recompute = Work(flops=core, mem_s=scores / memory_bandwidth_Bps)
    else:
        recompute = Work()
    return PartWork(forward=forward, backward=backward, recompute=recompute)


def roofline_embedding(job: Job, memory_bandwidth_Bps: float) -> PartWork:
    """Word (+ learned position) embedding on the first stage: a memory-bound gather.

    The backward writes a dense (vocab/t x h) gradient and adds it into the fp32 main grad."""
    w, layout, x = job.workload, job.layout, _shape(job)
    n, h, e, sp = x["n"], x["h"], x["e"], x["sp"]
    fwd = 2 * e * n * h + (3 * e * n * h if w.position_embedding_type == "learned_absolute" else 0)
    fwd += (2 * e + 1) * n * h / sp if w.hidden_dropout > 0 else 0
    bwd = 2 * e * n * h + w.padded_vocab_size(layout.tp) // layout.tp * h * (e + 8)
    return PartWork(forward=Work(mem_s=fwd / memory_bandwidth_Bps), backward=Work(mem_s=bwd / memory_bandwidth_Bps))


def roofline_output(job: Job, memory_bandwidth_Bps: float, gemm: GemmCurve | None = None) -> PartWork:
    """Final norm, output layer (2bshV/t) and vocab-parallel cross-entropy on the last stage."""
    w, layout, x = job.workload, job.layout, _shape(job)
    n, h, e, sp = x["n"], x["h"], x["e"], x["sp"]
    vocab = w.padded_vocab_size(layout.tp) // layout.tp
    forward, dgrad, wgrad = _linear(gemm or gemm_curve(None, w.precision), n, vocab, h)
    fwd = (2 * e * n * h / sp + (16 + e) * n * vocab) / memory_bandwidth_Bps   # norm; logits in fp32, 4 passes
    bwd = (2 * e * n * h / sp + (8 + e) * n * vocab) / memory_bandwidth_Bps
    return PartWork(forward=Work(flops=forward, mem_s=fwd), backward=Work(flops=dgrad + wgrad, mem_s=bwd))


def _profiled(fwd_s: float, bwd_s: float, rc_s: float, rate: float) -> PartWork:
    return PartWork(forward=Work(flops=fwd_s * rate), backward=Work(flops=bwd_s * rate),
                    recompute=Work(flops=rc_s * rate))


def profiled_rate(profile: LayerProfile, cluster: Cluster) -> float:
    """GEMM FLOP/s of the device while it was profiled: profiled seconds x this = work."""
    return profile.gemm_flops if profile.gemm_flops is not None else float(cluster.gemm_flops[profile.rank])


def profile_layer(profile: LayerProfile, job: Job, cluster: Cluster) -> PartWork | None:
    """The measured layer (None when this TP size was not profiled). Entries with
    recomputation include the recomputed forward in backward_s; split it out."""
    layout = job.layout
    tp, mbs, sp, rc = layout.tp, layout.micro_batch_size, layout.sequence_parallel, layout.recompute_granularity
    base = profile.layer(tp, mbs, sp, None)
    with_rc = profile.layer(tp, mbs, sp, rc) if rc else None
    if base is None and with_rc is None:
        return None
    rate = profiled_rate(profile, cluster)
    fwd = (base or with_rc).forward_s
    if rc is None:
        return _profiled(fwd, base.backward_s, 0.0, rate)
    if base is not None and with_rc is not None:
        extra = max(with_rc.backward_s - base.backward_s, 0.0)
    else:
        model = roofline_layer(job, cluster.memory_bandwidth_Bps, gemm_curve(cluster.gpu, job.workload.precision),
                               attention_curve(cluster.gpu, job.workload.attention_backend))
        share = (model.recompute.flops / rate + model.recompute.mem_s) / (model.forward.flops / rate + model.forward.mem_s)
        extra = fwd * share
    backward = base.backward_s if base is not None else with_rc.backward_s - extra
    return _profiled(fwd, backward, extra, rate)


def _profile_part(entry, rate: float) -> PartWork | None:
    return None if entry is None else _profiled(entry.forward_s, entry.backward_s, 0.0, rate)


@dataclass(frozen=True, kw_only=True)
class StageWork:
    """Work of one micro-batch per (pipeline stage, model chunk), compute only."""

    forward: np.ndarray
    """(2, p, v): [0] effective FLOPs, [1] memory-bound seconds."""
    backward: np.ndarray
    """(2, p, v) without recomputation."""
    recompute: np.ndarray
    """(2, p, v) recomputed forward work, added to the backward."""
    layers: np.ndarray
    """(p, v) transformer layers per chunk."""
    recomputed_layers: np.ndarray
    """(p, v) layers whose forward (and its TP collectives) is redone: full recomputation only."""
    profiled: bool
    """True when the layer times came from the LayerProfile."""
    overlap: np.ndarray
    """(3, 2) effective FLOPs of the data- and weight-gradient GEMMs of the column-parallel
    linears (QKV, fc1 of every layer; the output layer), behind which Megatron runs their
    backward TP collectives (the roofline's GEMMs, also when the layer time is profiled)."""


def _as_array(work: Work) -> np.ndarray:
    return np.array([work.flops, work.mem_s])


def stage_work(job: Job, cluster: Cluster, profile: LayerProfile | None = None) -> StageWork:
    """Per-chunk work: layers x layer + embedding on (0, 0) + output layer on (p-1, v-1)."""
    layout, v = job.layout, job.virtual_stages
    bw, gemm = cluster.memory_bandwidth_Bps, gemm_curve(cluster.gpu, job.workload.precision)
    layer = profile_layer(profile, job, cluster) if profile else None
    profiled = layer is not None
    layer = layer or roofline_layer(job, bw, gemm, attention_curve(cluster.gpu, job.workload.attention_backend))
    rate = profiled_rate(profile, cluster) if profile else 0.0
    embed = (profile and _profile_part(profile.embedding_entry(layout.tp, layout.micro_batch_size), rate)) \
        or roofline_embedding(job, bw)
    out = (profile and _profile_part(profile.output_entry(layout.tp, layout.micro_batch_size), rate)) \
        or roofline_output(job, bw, gemm)
    layers = np.array(job.stage_layers, dtype=float)[:, None] / v * np.ones(v)
    recomputed = _recomputed_layers(layout, layers)
    rc_layers = layers if layout.recompute_granularity == "selective" else recomputed
    fwd = _as_array(layer.forward)[:, None, None] * layers
    bwd = _as_array(layer.backward)[:, None, None] * layers
    rc = _as_array(layer.recompute)[:, None, None] * rc_layers
    fwd[:, 0, 0] += _as_array(embed.forward)
    bwd[:, 0, 0] += _as_array(embed.backward)
    fwd[:, -1, -1] += _as_array(out.forward)
    bwd[:, -1, -1] += _as_array(out.backward)
    x, linears = _shape(job), _layer_linears(job)
    output = (job.workload.padded_vocab_size(layout.tp) // layout.tp, x["h"])
    overlap = np.array([_linear(gemm, x["n"], *shape)[1:]
                        for shape in [linears[name] for name in COLUMN_PARALLEL] + [output]])
    return StageWork(forward=fwd, backward=bwd, recompute=rc, layers=layers, recomputed_layers=recomputed,
                     profiled=profiled, overlap=overlap)


def _recomputed_layers(layout: Layout, layers: np.ndarray) -> np.ndarray:
    """Layers under full recomputation: uniform recomputes all; block the first n of each chunk."""
    if layout.recompute_granularity != "full":
        return np.zeros_like(layers)
    if layout.recompute_method == "block":
        return np.minimum(layers, layout.recompute_num_layers)
    return layers.copy()
