"""Compute time of one micro-batch, per pipeline stage and model chunk.

Work is kept in two parts so one array operation prices every tensor-parallel
group at its own speed: `flops` (effective GEMM FLOPs, already divided by the
shape's GEMM efficiency) run at the group's slowest device's `gemm_flops` (the
rate of a large, 8192^3 GEMM); `mem_s` (memory-bound operations, bytes / memory
bandwidth) does not scale with GEMM speed. Stages price flops at the step rate
(Cluster.step_gemm_flops: the GEMM rate times the step GEMM fraction, a fitted
correction of the roofline's prices). A LayerProfile replaces the roofline: its
times become flops = time * the rate the profiled device had while profiled
(alone) * the same fraction (measured_rate), so a measured second comes back a
second on the profiled device, not corrected again, and scales with each group's
probed rate (every device loaded at once).

Roofline per transformer layer, per TP rank (b micro-batch, s sequence, h
hidden, a heads, g query groups, d head dim, f ffn, t TP):
  forward GEMM FLOPs  2bs h(a+2g)d/t  (QKV)  + 4b s^2 a d/t (scores, AV; half
                      with causal flash/fused kernels, which skip the masked half,
                      at their measured rate where there is one; a sliding window's
                      layers the key blocks inside it) + 2bs a d h/t (proj)
                      + 2bs h f (2 or 3 with SwiGLU)/t (MLP)
  backward            each linear's data- and weight-gradient GEMMs (2x the
                      forward FLOPs, at their own shapes' efficiency)
  memory-bound        norms, bias-dropout-add, activation, RoPE, and the
                      softmax/dropout of the score matrix without flash
                      attention (bytes moved, docs/time-model.md); backward 2x
Recomputation adds forward work to the backward: full, the whole layer for
each recomputed layer (uniform: all, block n: n per model chunk); selective,
the --recompute-modules of every layer (by default the attention core).
A chunk's pass takes no less than the host needs to launch its layers' kernels
(ChunkWork.host_s, cost.launch), less what CUDA graphs capture; profiled layers
hold that time already.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from megatron_pipette.cost.experts import moe_mlp
from megatron_pipette.cost.gemm import (
    AttentionCurve,
    GemmCurve,
    LinearFlops,
    PartWork,
    Work,
    attention_curve,
    fp8_cast_bytes,
    fp8_curve,
    gemm_curve,
    gemm_work,
    linear_work,
    main_grad_bytes,
)
from megatron_pipette.cost.launch import HostFloor, layer_floor
from megatron_pipette.spec.hardware import Cluster
from megatron_pipette.spec.job import Job
from megatron_pipette.spec.layer_profile import LayerProfile, profile_extrapolations
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import Workload

FLASH_BACKENDS = ("auto", "flash", "fused")
"""Attention backends that keep no s*s score matrix (no softmax/dropout memory traffic) and whose
causal kernels skip the masked half of the scores."""
ATTENTION_TILE = 128
"""Queries, and keys, a flash or cuDNN attention kernel computes as one block (FlashAttention-2's
forward tile at head width 64, GPT-OSS's, recalled from its launch templates, not read here; at
width 128 its key block is 64 wide, which this does not follow; FlashAttention-3's and cuDNN's are
taken to be the same, not checked): a block is computed whole once any of its pairs is inside the mask, so a sliding
window of w keys costs every query block the key blocks from its first query's earliest key to its
own, ceil(w / 128) + 1 of them, not w / 128."""
BACKWARD_MEMORY_FACTOR = 2.0
"""Backward of an elementwise op reads the saved input and the incoming gradient and writes one."""


def _layer_linears(job: Job) -> dict[str, tuple[int, int, int]]:
    """(tokens, out, in) of each linear of a transformer layer on one TP rank, attention first: a
    column-parallel linear holds out / TP, a row-parallel one in / TP; MLA's duplicated down
    projections are whole and, under sequence parallelism, run on the rank's share of the tokens."""
    x, w, t = _shape(job), job.workload, job.layout.tp
    n, f, h = x.tokens, x.ffn, x.hidden
    per_rank = {"column": lambda out, inp: (n, out // t, inp), "row": lambda out, inp: (n, out, inp // t),
                "duplicated": lambda out, inp: (n // x.sp, out, inp)}
    attention = {name: per_rank[split](out, inp) for name, (out, inp, split) in w.attention_linears().items()}
    return {**attention, "fc1": (n, f * w.fc1_widening, h), "fc2": (n, h, f)}


def _column_attention(workload: Workload) -> list[str]:
    """The attention's column-parallel linears, QKV or MLA's up projections: one TP collective
    before them (cost.timing), their GEMMs summed where a collective overlaps them."""
    return [name for name, (_, _, split) in workload.attention_linears().items() if split == "column"]


def attention_input_width(workload: Workload) -> int:
    """Width of what the attention's column-parallel linears take in, per token: the TP
    collective before them (SP: all-gather; else the input-gradient all-reduce after them).
    MLA's are its latents (and the keys' shared rotary part, gathered beside them under SP)."""
    linears = workload.attention_linears()
    return (sum(linears[name][1] for name in _column_attention(workload))
            + (workload.qk_pos_emb_head_dim if workload.multi_latent_attention else 0))


class RankShape(NamedTuple):
    """The sizes one TP rank computes with, per micro-batch."""

    tokens: int
    """The rank's context-parallel share of the micro-batch's tokens."""
    micro_batch: int
    seq_length: int
    cp: int
    hidden: int
    heads: int
    """Attention heads on this TP rank."""
    query_groups: int
    """Query groups on this TP rank."""
    query_head_dim: int
    value_head_dim: int
    ffn: int
    """FFN columns on this TP rank."""
    element_bytes: int
    sp: int
    """What sequence parallelism splits the sequence by: the TP size, or 1 without it."""


def _shape(job: Job) -> RankShape:
    w, layout = job.workload, job.layout
    t = layout.tp
    return RankShape(tokens=job.tokens_per_microbatch, micro_batch=layout.micro_batch_size, seq_length=w.seq_length,
                     cp=layout.cp, hidden=w.hidden_size, heads=w.num_attention_heads // t,
                     query_groups=w.query_groups // t, query_head_dim=w.query_head_dim,
                     value_head_dim=w.value_head_dim, ffn=w.ffn // t, element_bytes=w.bytes_per_element,
                     sp=layout.tp if layout.sequence_parallel else 1)


class ForwardBackward(NamedTuple):
    """Effective FLOPs of one computation's forward and backward."""

    forward: float
    backward: float


def core_attention(*, shape: RankShape, gemm: GemmCurve, attention: AttentionCurve | None, causal_kernel: bool,
                   window: int | None = None) -> ForwardBackward:
    """(forward, backward) effective FLOPs of the attention core (scores over query/key heads of
    width dq, weighted values of width dv) of the `shape`'s b sequences of a heads on one TP rank,
    which holds s / cp of the queries (context parallelism balances the causal work over its ranks).
    Unfused attention multiplies the full s x s scores and masks them; causal flash/fused kernels
    skip the masked half: half the FLOPs, at the kernel's measured rate where there is one
    (`attention`, at the size of one of the cp block calls that context parallelism makes), else at
    the GEMM curve's; with a sliding `window` (earlier keys; one CP rank only) they compute its
    blocks only."""
    b, a, s, cp = shape.micro_batch, shape.heads, shape.seq_length, shape.cp
    dq, dv = shape.query_head_dim, shape.value_head_dim
    q = s // cp
    full = gemm_work(gemm, q, s, dq, b * a) + gemm_work(gemm, q, dv, s, b * a)
    if not causal_kernel:
        return ForwardBackward(forward=full, backward=2 * full)
    share = 1.0 if window is None else windowed_share(s, window)
    if attention is None:
        return ForwardBackward(forward=share * full / 2, backward=share * full)
    flops = share * b * a * q * s * (dq + dv)
    return ForwardBackward(forward=flops / attention.efficiency(0, flops / cp),
                           backward=2 * flops / attention.efficiency(1, 2 * flops / cp))


def windowed_share(s: int, window: int) -> float:
    """Of the key blocks a causal kernel computes over s queries and keys, the share a sliding window
    of `window` earlier keys computes (ATTENTION_TILE): query block i needs key blocks
    (i * tile - window) // tile up to i."""
    blocks = -(-s // ATTENTION_TILE)
    i = np.arange(blocks)
    first = np.maximum(0, i * ATTENTION_TILE - window) // ATTENTION_TILE
    return float((i - first + 1).sum() / (blocks * (blocks + 1) / 2))


def roofline_layer(job: Job, memory_bandwidth_Bps: float, gemm: GemmCurve | None = None,
                   attention: AttentionCurve | None = None, *, moe: PartWork | None = None,
                   linear: GemmCurve | None = None) -> PartWork:
    """One transformer layer on one TP rank; `gemm` None: the parametric curve (no GPU named);
    `attention`: the causal kernel's measured curve, where the GPU has one; `moe`: an MoE layer's
    MLP (cost.experts.moe_mlp), in place of the dense one; `linear`: the curve of the layer's
    linears where it differs from `gemm` (FP8: cost.gemm.fp8_curve)."""
    w, layout, x = job.workload, job.layout, _shape(job)
    n, h, f, e, sp = x.tokens, x.hidden, x.ffn, x.element_bytes, x.sp
    gemm = gemm or gemm_curve(None, w.precision)
    core, core_backward = core_attention(shape=x, gemm=gemm, attention=attention,
                                         causal_kernel=w.attention_backend in FLASH_BACKENDS)
    shapes = _layer_linears(job)
    if moe is not None:
        shapes = {name: shape for name, shape in shapes.items() if name not in ("fc1", "fc2")}
    linear = linear or gemm
    linears = [linear_work(linear, *shape, main_grad_bytes=main_grad_bytes(w)) for shape in shapes.values()]
    cast_f, cast_b = fp8_cast_bytes(w.quantisation_recipe, list(shapes.values()))
    drop = 1 if w.hidden_dropout > 0 else 0
    hidden = (2 * 2 * e + 2 * (3 * e + drop)) * n * h / sp          # two norms, two bias-dropout-adds
    norm = 2 * e * n * h / sp
    act = 0 if moe is not None else (w.fc1_widening + 1) * e * n * f
    scores = 0.0
    if w.attention_backend not in FLASH_BACKENDS:
        scores = ((2 * e + (2 * e + 1 if w.attention_dropout > 0 else 0)) * x.micro_batch * x.heads * x.seq_length
                  * x.seq_length)
    mem = (hidden + act + _attention_elementwise_bytes(job) + scores) / memory_bandwidth_Bps
    rope_f, rope_b = _unfused_rope_bytes(job)
    forward = Work(flops=core + sum(fwd for fwd, _, _ in linears), mem_s=mem + (rope_f + cast_f) / memory_bandwidth_Bps)
    backward = Work(flops=core_backward + sum(dgrad + wgrad for _, dgrad, wgrad in linears),
                    mem_s=BACKWARD_MEMORY_FACTOR * mem + (rope_b + cast_b) / memory_bandwidth_Bps)
    if moe is not None:
        forward, backward = forward + moe.forward, backward + moe.backward
    if layout.recompute_granularity == "full":
        recompute = forward
    else:
        # Selective: what --recompute-modules redoes (a dense layer's norms are fused into QKV and
        # fc1 under Transformer Engine, where layernorm redoes nothing; an MoE layer's pre-MLP norm
        # is its own module).
        redone = layout.selective_modules
        recompute = Work(flops=core, mem_s=scores / memory_bandwidth_Bps) if "core_attn" in redone else Work()
        if "mla_up_proj" in redone:   # MLA's up projections and the query and key they assemble
            up = [fwd for name, (fwd, _, _) in zip(shapes, linears) if name in _column_attention(w)]
            recompute = recompute + Work(flops=sum(up), mem_s=_rope_bytes(job) / memory_bandwidth_Bps)
        if moe is not None:
            recompute = recompute + moe.recompute + (Work(mem_s=norm / memory_bandwidth_Bps) if "layernorm" in redone
                                                     else Work())
        elif "mlp" in redone:
            forward_flops = {name: fwd for name, (fwd, _, _) in zip(shapes, linears)}
            recompute = recompute + Work(flops=forward_flops["fc1"] + forward_flops["fc2"],
                                         mem_s=act / memory_bandwidth_Bps)
    return PartWork(forward=forward, backward=backward, recompute=recompute)


def _attention_elementwise_bytes(job: Job) -> float:
    """Memory traffic of the attention's elementwise passes on one TP rank: RoPE on the query and
    key heads (MLA: assembling every head's query and key from its content and rotary parts, which
    also applies its rotary embedding whatever --position-embedding-type says) and the
    --qk-layernorm norms (MLA's on the latents, sharded only by SP)."""
    w, x = job.workload, _shape(job)
    n, a, g, dq, e = x.tokens, x.heads, x.query_groups, x.query_head_dim, x.element_bytes
    if w.multi_latent_attention:
        norms = 2 * e * n * sum(w.qk_norm_widths()) / x.sp
    else:
        norms = 2 * e * n * (a + g) * dq if w.qk_layernorm else 0
    return _rope_bytes(job) + norms


def _rope_bytes(job: Job) -> float:
    """The RoPE part of _attention_elementwise_bytes (MLA: the query and key assembled with it,
    which --recompute-modules mla_up_proj redoes)."""
    w, x = job.workload, _shape(job)
    n, a, g, dq, e = x.tokens, x.heads, x.query_groups, x.query_head_dim, x.element_bytes
    if w.multi_latent_attention:
        return 2 * e * n * 2 * a * dq
    return 2 * e * n * (a + g) * dq if w.position_embedding_type in ("rope", "yarn") else 0


def _unfused_rope_bytes(job: Job) -> tuple[float, float]:
    """(forward, backward) traffic RoPE adds beyond _rope_bytes' fused kernel where megatron-core
    cannot fuse it: Transformer Engine's fused RoPE takes no scale, so a YaRN concentration factor
    other than 1 (Workload.rope_concentration_factor) runs models/common/embeddings/rope_utils.py's
    _apply_rotary_pos_emb_bshd on the query and key heads (megatron-core 0.19): the half negated
    (1 pass of the heads read and written), the halves concatenated (2), the products with the
    cosines and sines (2 each), their sum (3) and the final concatenation (2), 12 where the kernel
    moves 2; its backward about as many (the products' gradients, 2 each; the negation's, 1; the
    halves' gradients joined, 2; the two gradients summed, 3), 10 where the rule for elementwise
    backwards (BACKWARD_MEMORY_FACTOR) gives the kernel 4."""
    if job.workload.rope_concentration_factor == 1.0:
        return 0.0, 0.0
    heads = _rope_bytes(job) / 2
    return 10 * heads, 6 * heads


def roofline_embedding(job: Job, memory_bandwidth_Bps: float) -> PartWork:
    """Word (+ learned position) embedding on the first stage: a memory-bound gather.

    The backward writes a dense (vocab/t x h) gradient and adds it into the fp32 main grad."""
    w, layout, x = job.workload, job.layout, _shape(job)
    n, h, e, sp = x.tokens, x.hidden, x.element_bytes, x.sp
    fwd = 2 * e * n * h + (3 * e * n * h if w.position_embedding_type == "learned_absolute" else 0)
    fwd += (2 * e + 1) * n * h / sp if w.hidden_dropout > 0 else 0
    bwd = 2 * e * n * h + w.padded_vocab_size(layout.tp) // layout.tp * h * (e + 8)
    return PartWork(forward=Work(mem_s=fwd / memory_bandwidth_Bps), backward=Work(mem_s=bwd / memory_bandwidth_Bps))


def mtp_projection(job: Job, memory_bandwidth_Bps: float, linear: GemmCurve) -> PartWork:
    """One MTP layer's own work beside its transformer layer, its embedding lookup and its output
    layer and loss (megatron-core 0.19, MultiTokenPredictionLayer._concat_embeddings): the
    embedding's and the hidden state's norms, their concatenation (2h a token read and written)
    and the column-parallel 2h-to-h projection."""
    x = _shape(job)
    n, h, e, sp = x.tokens, x.hidden, x.element_bytes, x.sp
    fwd, dgrad, wgrad = linear_work(linear, n, h // job.layout.tp, 2 * h, main_grad_bytes(job.workload))
    mem = (2 * 2 * e * n * h + 2 * 2 * e * n * h) / sp / memory_bandwidth_Bps
    return PartWork(forward=Work(flops=fwd, mem_s=mem),
                    backward=Work(flops=dgrad + wgrad, mem_s=BACKWARD_MEMORY_FACTOR * mem))


def _mtp_acceptance_bytes(job: Job) -> float:
    """An MTP layer's acceptance count in training (process_mtp_loss, _compute_mtp_acceptance_counts):
    an argmax over its vocab-parallel logits, one more read of them (its two per-token all-gathers
    over TP are left out)."""
    layout = job.layout
    return job.workload.bytes_per_element * job.tokens_per_microbatch * \
        (job.workload.padded_vocab_size(layout.tp) // layout.tp)


CROSS_ENTROPY_BANDWIDTH_SHARE = 0.715
"""The share of the measured copy rate the cross-entropy's passes attain: row reductions 16k-128k
wide and in-place read-modify-writes run slower per byte than a copy. MEASURED on an H200
(benchmarks/results/h200-2026-11-26-loss: 32 passes, plain and fused, forward and backward, 8192
and 16384 tokens x 16384-128256 logits a rank; median 0.715, range 0.59-0.80), not fitted."""


def cross_entropy_bytes(e: int, fusion: str | None) -> tuple[int, int]:
    """Bytes the vocab-parallel cross-entropy moves per logit of `e` bytes, (forward, backward), for
    the plain one (`fusion` None) and the fused ones (Workload.cross_entropy_fusion).

    megatron-core 0.19, tensor_parallel/cross_entropy.py: `.float()` (read e, write 4; none in
    fp32), the max (read 4), the in-place subtract and exp (8 each), the sum (4), the divide that
    leaves the softmax for backward (8); backward the in-place multiply (8) and autograd's cast back
    to the logits' dtype (4 + e; none in fp32). With --cross-entropy-loss-fusion
    (fusions/fused_cross_entropy.py, torch.compile'd) the cast and the max are one kernel, the
    subtract, exp and sum one, then the divide; its backward costs what the plain one does (the
    H200 timed it so: the in-place multiply on the saved softmax is not merged with the cast).
    Transformer Engine's (te, common/triton/cross_entropy.py in TE 2.20, as Megatron calls it:
    the input not overwritten) reads the logits once forward with an online softmax and copies
    them for the backward (e + e), which reads the copy and writes the gradient into it (e + e)."""
    if fusion == "te":
        return 2 * e, 2 * e
    cast = 0 if e == 4 else e + 4
    backward = 8 + (0 if e == 4 else 4 + e)
    if fusion == "native":
        return (cast or 4) + 8 + 8, backward
    return cast + 4 + 8 + 8 + 4 + 8, backward


def roofline_output(job: Job, memory_bandwidth_Bps: float, gemm: GemmCurve | None = None) -> PartWork:
    """Final norm, output layer (2bshV/t) and vocab-parallel cross-entropy on the last stage."""
    w, layout, x = job.workload, job.layout, _shape(job)
    n, h, e, sp = x.tokens, x.hidden, x.element_bytes, x.sp
    vocab = w.padded_vocab_size(layout.tp) // layout.tp
    forward, dgrad, wgrad = linear_work(gemm or gemm_curve(None, w.precision), n, vocab, h, main_grad_bytes(w))
    ce_forward, ce_backward = (b / CROSS_ENTROPY_BANDWIDTH_SHARE for b in
                               cross_entropy_bytes(e, w.cross_entropy_fusion))
    fwd = (2 * e * n * h / sp + ce_forward * n * vocab) / memory_bandwidth_Bps   # the final norm, the loss
    bwd = (2 * e * n * h / sp + ce_backward * n * vocab) / memory_bandwidth_Bps
    return PartWork(forward=Work(flops=forward, mem_s=fwd), backward=Work(flops=dgrad + wgrad, mem_s=bwd))


def _profiled(fwd_s: float, bwd_s: float, rc_s: float, rate: float) -> PartWork:
    return PartWork(forward=Work(flops=fwd_s * rate), backward=Work(flops=bwd_s * rate),
                    recompute=Work(flops=rc_s * rate))


def profiled_rate(profile: LayerProfile, cluster: Cluster) -> float:
    """GEMM FLOP/s of the device while it was profiled (the probe's rate, alone)."""
    return profile.gemm_flops if profile.gemm_flops is not None else float(cluster.gemm_flops[profile.rank])


def measured_rate(profile: LayerProfile, cluster: Cluster) -> float:
    """Effective FLOPs per profiled second: profiled seconds x this = work, in the units stages price
    at the step rate (Cluster.step_gemm_flops). The step GEMM fraction corrects the roofline's prices
    of kernels timed alone; a profile timed the layer as it runs, so its seconds take the fraction in
    here and come back unchanged on the profiled device (profiled_rate / device rate elsewhere)."""
    return profiled_rate(profile, cluster) * cluster.step_gemm_fraction


def profile_layer(profile: LayerProfile, job: Job, cluster: Cluster) -> PartWork | None:
    """The measured layer (None when this TP and CP size was not profiled). Entries with
    recomputation include the recomputed forward in backward_s; split it out. Under context
    parallelism the profile timed one rank's shard attending to its own keys; the keys of the
    other ranks are added at the roofline's attention rate (_keys_beyond_the_shard)."""
    layout = job.layout
    tp, mbs, sp, rc = layout.tp, layout.micro_batch_size, layout.sequence_parallel, layout.recompute_granularity
    base = profile.layer(tp, mbs, sp, None, layout.cp)
    with_rc = profile.layer(tp, mbs, sp, rc, layout.cp) if rc else None
    if base is None and with_rc is None:
        return None
    measured = _measured_layer(job, cluster, measured_rate(profile, cluster), base, with_rc)
    return measured if layout.cp == 1 else _add(measured, _keys_beyond_the_shard(job, cluster))


def _add(a: PartWork, b: PartWork) -> PartWork:
    return PartWork(forward=a.forward + b.forward, backward=a.backward + b.backward,
                    recompute=a.recompute + b.recompute)


def _keys_beyond_the_shard(job: Job, cluster: Cluster) -> PartWork:
    """A CP rank's s/CP queries meet all s keys (causal halves balanced over the ranks); its
    profiled shard met only its own s/CP: the difference in attention work, forward, backward and
    where recomputation redoes the attention core."""
    w, layout, x = job.workload, job.layout, _shape(job)
    gemm, attention = gemm_curve(cluster.gpu, w.precision), attention_curve(cluster.gpu, w.attention_backend)
    causal = w.attention_backend in FLASH_BACKENDS
    whole = core_attention(shape=x, gemm=gemm, attention=attention, causal_kernel=causal)
    shard = core_attention(shape=x._replace(seq_length=x.seq_length // x.cp, cp=1), gemm=gemm, attention=attention,
                           causal_kernel=causal)
    forward, backward = whole.forward - shard.forward, whole.backward - shard.backward
    redone = layout.recompute_granularity == "full" or "core_attn" in layout.selective_modules
    return PartWork(forward=Work(flops=forward), backward=Work(flops=backward),
                    recompute=Work(flops=forward if redone else 0.0))


def _measured_layer(job: Job, cluster: Cluster, rate: float, base, with_rc) -> PartWork:
    rc = job.layout.recompute_granularity
    fwd = (base or with_rc).forward_s
    if rc is None:
        return _profiled(fwd, base.backward_s, 0.0, rate)
    if base is not None and with_rc is not None:
        extra = max(with_rc.backward_s - base.backward_s, 0.0)
    else:
        model = roofline_layer(job, cluster.memory_bandwidth_Bps, gemm_curve(cluster.gpu, job.workload.precision),
                               attention_curve(cluster.gpu, job.workload.attention_backend))
        share = model.recompute.seconds(rate) / model.forward.seconds(rate)
        extra = fwd * share
    backward = base.backward_s if base is not None else with_rc.backward_s - extra
    return _profiled(fwd, backward, extra, rate)


def _profile_part(entry, rate: float) -> PartWork | None:
    return None if entry is None else _profiled(entry.forward_s, entry.backward_s, 0.0, rate)


class ChunkWork(NamedTuple):
    """Work of one micro-batch per (pipeline stage, model chunk): cost.gemm.Work with a (p, v) array
    in each field."""

    flops: np.ndarray
    """(p, v) effective GEMM FLOPs: seconds = flops / the stage's GEMM FLOP/s."""
    mem_s: np.ndarray
    """(p, v) memory-bound seconds."""
    host_s: np.ndarray | float = 0.0
    """(p, v) seconds the host takes to launch the layers' kernels (cost.launch): the floor under
    the device's time; 0 where the layers are profiled, whose times hold it already."""

    def seconds(self, rate: np.ndarray | float) -> np.ndarray:
        """Seconds at `rate` GEMM FLOP/s (broadcast against (p, v)), never below the host's floor."""
        return np.maximum(self.flops / rate + self.mem_s, self.host_s)


class LayerLinears(NamedTuple):
    """Effective FLOPs of the GEMMs beside which Megatron runs a layer's tensor-parallel collectives
    (the roofline's, also when the layer time is profiled): the backward ones of the column-parallel
    linears (qkv, fc1, output) hide their asynchronous collectives; --tp-comm-overlap pipelines the
    forward and data-gradient ones of qkv, proj, fc1 and fc2 with the collectives beside them."""

    qkv: LinearFlops
    """The attention's column-parallel linears, summed: QKV, or MLA's up projections."""
    proj: LinearFlops
    """The attention's output projection (row parallel)."""
    fc1: LinearFlops
    """The MLP's first linear (column parallel)."""
    fc2: LinearFlops
    """The MLP's second linear (row parallel)."""
    output: LinearFlops
    """The output layer (column parallel, last stage), at the training dtype's curve also under FP8."""


@dataclass(frozen=True, kw_only=True)
class StageWork:
    """Work of one micro-batch per (pipeline stage, model chunk), compute only."""

    forward: ChunkWork
    backward: ChunkWork
    """Without recomputation."""
    recompute: ChunkWork
    """Recomputed forward work, added to the backward."""
    layers: np.ndarray
    """(p, v) transformer layers per chunk."""
    recomputed_layers: np.ndarray
    """(p, v) layers whose forward (and its TP collectives) is redone: full recomputation only."""
    moe_layers: np.ndarray
    """(p, v) of the layers, those with an MoE MLP (their dispatch is priced in cost.timing)."""
    moe_recomputed: np.ndarray
    """(p, v) of the recomputed layers, the MoE ones."""
    moe_blocks_redone: np.ndarray
    """(p, v) MoE layers whose MoE block, dispatch included, selective recomputation redoes (moe)."""
    mlp_redone: np.ndarray
    """(p, v) layers whose dense MLP, TP collectives included, selective recomputation redoes (mlp;
    an MoE layer's shared experts under moe or shared_experts)."""
    attention_core: ForwardBackward
    """One layer's attention core: what context parallelism's key/value exchange hides behind."""
    profiled: bool
    """True when the dense layers' times came from the LayerProfile (MoE layers, which the profile
    does not time, are the roofline's; so is every layer under a CP size whose shard it did not time)."""
    linears: LayerLinears
    """One layer's linears (and the output layer's), for the TP collectives beside them (cost.timing)."""
    moe_layer: PartWork | None = None
    """One MoE layer's work, and of it the MLP half (cost.experts.moe_mlp), for the schedule that
    runs their parts apart (--overlap-moe-expert-parallel-comm, cost.timing); None without it."""
    moe_mlp: PartWork | None = None
    extrapolations: tuple[str, ...] = ()
    """What the layer profile was used for beyond what it measured (spec.layer_profile.profile_extrapolations)."""


def _chunks(dense: Work, moe: Work, count: np.ndarray, moe_count: np.ndarray) -> ChunkWork:
    """`count` layers per chunk, `moe_count` of them with the MoE layer's work, the rest the dense one's."""
    return ChunkWork(flops=dense.flops * (count - moe_count) + moe.flops * moe_count,
                     mem_s=dense.mem_s * (count - moe_count) + moe.mem_s * moe_count)


def _add_at(chunks: ChunkWork, stage: int, chunk: int, work: Work) -> None:
    """Add `work` to one (stage, chunk) of `chunks`, in place."""
    chunks.flops[stage, chunk] += work.flops
    chunks.mem_s[stage, chunk] += work.mem_s


def _summed(linears: list[LinearFlops]) -> LinearFlops:
    return LinearFlops(*(sum(gemms) for gemms in zip(*linears)))


def stage_work(job: Job, cluster: Cluster, profile: LayerProfile | None = None) -> StageWork:
    """Per-chunk work: layers x layer + embedding on (0, 0) + output layer on (p-1, v-1)."""
    layout, w = job.layout, job.workload
    bw, gemm = cluster.memory_bandwidth_Bps, gemm_curve(cluster.gpu, w.precision)
    recipe = w.quantisation_recipe
    linear = fp8_curve(cluster.gpu, w.precision, recipe) if recipe else gemm
    attention = attention_curve(cluster.gpu, w.attention_backend)
    profile = profile if profile is not None and profile.covers(job) else None
    layer = profile_layer(profile, job, cluster) if profile else None
    profiled = layer is not None
    layer = layer or roofline_layer(job, bw, gemm, attention, linear=linear)
    rate = measured_rate(profile, cluster) if profile else 0.0
    embed = (profile and _profile_part(profile.embedding_entry(layout.tp, layout.micro_batch_size, layout.cp),
                                       rate)) or roofline_embedding(job, bw)
    out = (profile and _profile_part(profile.output_entry(layout.tp, layout.micro_batch_size, layout.cp), rate)) \
        or roofline_output(job, bw, gemm)
    layers = np.array(job.chunk_sizes, dtype=float)
    recomputed = _recomputed_layers(layout, layers)
    moe, moe_rc = _moe_counts(job, layers)
    mtp = w.mtp_layers
    if mtp:   # the last chunk's; full recomputation checkpoints each whole (MultiTokenPredictionLayer)
        redone = mtp if layout.recompute_granularity == "full" else 0
        layers[-1, -1] += mtp
        recomputed[-1, -1] += redone
        if w.mtp_layer_is_moe:
            moe[-1, -1] += mtp
            moe_rc[-1, -1] += redone
    rc_layers = layers if layout.recompute_granularity == "selective" else recomputed
    moe_rc_layers = moe if layout.recompute_granularity == "selective" else moe_rc
    experts = moe_mlp(job, bw, gemm, linear) if moe.any() else None
    paired = experts is not None and layout.overlap_moe_expert_parallel_comm   # cost.timing runs its halves apart
    sparse = roofline_layer(job, bw, gemm, attention, moe=experts, linear=linear) if experts is not None else layer
    dense_floor = HostFloor() if profiled else layer_floor(job, moe=False)
    moe_floor = layer_floor(job, moe=True) if experts is not None else dense_floor
    fwd = _chunks(layer.forward, sparse.forward, layers, moe)._replace(
        host_s=dense_floor.forward_s * (layers - moe) + moe_floor.forward_s * moe)
    bwd = _chunks(layer.backward, sparse.backward, layers, moe)._replace(
        host_s=dense_floor.backward_s * (layers - moe) + moe_floor.backward_s * moe)
    rc = _chunks(layer.recompute, sparse.recompute, rc_layers, moe_rc_layers)._replace(
        host_s=dense_floor.recompute_s * (rc_layers - moe_rc_layers) + moe_floor.recompute_s * moe_rc_layers)
    _add_at(fwd, 0, 0, embed.forward)
    _add_at(bwd, 0, 0, embed.backward)
    _add_at(fwd, -1, -1, out.forward)
    _add_at(bwd, -1, -1, out.backward)
    if mtp:   # each MTP layer embeds, projects, and computes the logits, loss and acceptance again
        projection = mtp_projection(job, bw, linear)
        extra = _add(_add(embed, out), projection)
        accept = Work(mem_s=_mtp_acceptance_bytes(job) / bw)
        _add_at(fwd, -1, -1, (extra.forward + accept).scaled(mtp))
        _add_at(bwd, -1, -1, extra.backward.scaled(mtp))
        if layout.recompute_granularity == "full":
            _add_at(rc, -1, -1, projection.forward.scaled(mtp))
    x = _shape(job)
    works = {name: linear_work(linear, *shape, main_grad_bytes=main_grad_bytes(w))
             for name, shape in _layer_linears(job).items()}
    vocab = w.padded_vocab_size(layout.tp) // layout.tp
    linears = LayerLinears(qkv=_summed([works[name] for name in _column_attention(w)]), proj=works["proj"],
                           fc1=works["fc1"], fc2=works["fc2"],
                           output=linear_work(gemm, x.tokens, vocab, x.hidden, main_grad_bytes(w)))
    causal = w.attention_backend in FLASH_BACKENDS
    core = core_attention(shape=x, gemm=gemm, attention=attention, causal_kernel=causal)
    redone = layout.selective_modules
    if job.window_layers:
        timed = _measured_over_roofline(layer, roofline_layer(job, bw, gemm, attention, linear=linear), rate) \
            if profiled else _MeasuredOverRoofline()
        _windowed(job, forward=fwd, backward=bwd, recompute=rc, full=core,
                  windowed=core_attention(shape=x, gemm=gemm, attention=attention, causal_kernel=causal,
                                          window=w.window),
                  core_redone="core_attn" in redone, timed=timed)
    blocks = moe if "moe" in redone else np.zeros_like(moe)
    shared = w.moe_shared_expert_intermediate_size is not None and bool(redone & {"moe", "shared_experts"})
    mlp_redone = (layers - moe if "mlp" in redone else np.zeros_like(layers)) + (moe if shared else 0)
    return StageWork(forward=fwd, backward=bwd, recompute=rc, layers=layers, recomputed_layers=recomputed,
                     moe_layers=moe, moe_recomputed=moe_rc, moe_blocks_redone=blocks, mlp_redone=mlp_redone,
                     attention_core=core, profiled=profiled, linears=linears,
                     moe_layer=sparse if paired else None, moe_mlp=experts if paired else None,
                     extrapolations=profile_extrapolations(profile, job) if profile else ())


class _MeasuredOverRoofline(NamedTuple):
    """Seconds of a measured layer over the roofline's for it, per part (1 each: a roofline layer)."""

    forward: float = 1.0
    backward: float = 1.0
    recompute: float = 1.0
    """0 where the roofline recomputes nothing."""


def _measured_over_roofline(measured: PartWork, roofline: PartWork, rate: float) -> _MeasuredOverRoofline:
    """The measured layer's seconds over the roofline's, both at `rate`."""
    def ratio(m: Work, r: Work) -> float:
        return float(m.seconds(rate) / r.seconds(rate)) if r.seconds(rate) > 0 else 0.0

    return _MeasuredOverRoofline(forward=ratio(measured.forward, roofline.forward),
                                backward=ratio(measured.backward, roofline.backward),
                                recompute=ratio(measured.recompute, roofline.recompute))


def _windowed(job: Job, *, forward: ChunkWork, backward: ChunkWork, recompute: ChunkWork, full: ForwardBackward,
              windowed: ForwardBackward, core_redone: bool, timed: _MeasuredOverRoofline) -> None:
    """Take from the forward, backward and recompute work of each chunk, in place, what its sliding-window
    layers' attention cores do not compute: the layers were priced (or profiled) with full attention;
    the recompute redoes the core under selective core_attn, the whole layer under full.

    A roofline layer loses the key blocks its core skips. A profiled dense layer was timed whole, its
    core and the rest together, so it loses the share of its measured time that the roofline layer
    loses of its own (`timed`: the measured over the roofline seconds, per direction and recompute,
    scale the roofline's saving): the window shortens only the core, and only the roofline says which
    part of the layer the core is. That share is below one, so a measured layer keeps a positive time
    however far its seconds are from the roofline's (a CPU's profile priced against a GPU's tables).
    MoE layers, never profiled, lose the roofline's blocks."""
    w = job.workload
    count, redone = _pattern_counts(job, job.window_layers, w.window_layer_pattern())
    moe, moe_redone = _pattern_counts(job, None, tuple(a and b for a, b in zip(w.window_layer_pattern(),
                                                                                w.moe_layer_pattern())))
    if not (core_redone and job.layout.recompute_granularity == "selective"):
        count_rc, moe_rc = redone, moe_redone
    else:
        count_rc, moe_rc = count, moe
    saved = full.forward - windowed.forward
    forward.flops[:] -= saved * (timed.forward * (count - moe) + moe)
    backward.flops[:] -= (full.backward - windowed.backward) * (timed.backward * (count - moe) + moe)
    recompute.flops[:] -= saved * (timed.recompute * (count_rc - moe_rc) + moe_rc)


def _moe_counts(job: Job, layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(p, v) MoE layers per chunk, and of them those full recomputation redoes."""
    if not job.moe_layers:
        return np.zeros_like(layers), np.zeros_like(layers)
    return _pattern_counts(job, job.moe_layers, job.workload.moe_layer_pattern())


def _pattern_counts(job: Job, per_chunk: tuple[tuple[int, ...], ...] | None,
                    pattern: tuple[bool, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(p, v) layers of a kind per chunk (`per_chunk`, the Job's count of `pattern`'s layers; None:
    counted here), and of them those full recomputation redoes (block: the first n of each chunk;
    uniform: all)."""
    counts = np.array(per_chunk if per_chunk is not None else _in_chunks(job, pattern), dtype=float)
    layout = job.layout
    if layout.recompute_granularity != "full":
        return counts, np.zeros_like(counts)
    if layout.recompute_method != "block":
        return counts, counts.copy()
    return counts, np.array(_in_chunks(job, pattern, first=layout.recompute_num_layers), dtype=float)


def _in_chunks(job: Job, pattern: tuple[bool, ...], first: int | None = None) -> list[list[int]]:
    """`pattern`'s layers in each (stage, chunk), among the first `first` layers of each (None: all)."""
    return [[sum(pattern[i] for i in chunk[:first]) for chunk in stage] for stage in job.chunk_layers()]


def _recomputed_layers(layout: Layout, layers: np.ndarray) -> np.ndarray:
    """Layers under full recomputation: uniform recomputes all; block the first n of each chunk."""
    if layout.recompute_granularity != "full":
        return np.zeros_like(layers)
    if layout.recompute_method == "block":
        return np.minimum(layers, layout.recompute_num_layers)
    return layers.copy()
