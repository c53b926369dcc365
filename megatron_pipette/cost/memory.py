"""Peak device memory of each pipeline stage of a Megatron-LM job.

A layout fits only if every pipeline rank fits, so the estimate is per stage:
model state (weights, fp32 gradients, Adam state, with or without the
distributed optimizer), the activations of the micro-batches Megatron's
schedule keeps in flight at the peak, the working memory live at that peak,
and explicit runtime overheads. Activations follow Korthikanti et al. 2022,
generalised for GQA, SwiGLU, any ffn width, disabled dropout, flash/fused
attention and any precision; docs/memory-model.md derives every term.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import NamedTuple

import numpy as np

from megatron_pipette.cost.experts import buffer_rows, fp8_input_bytes, moe_activation_bytes, moe_backward_bytes
from megatron_pipette.cost.fsdp import held_state
from megatron_pipette.cost.offload import resident_layers
from megatron_pipette.cost.parameters import StageParameters, stage_parameters
from megatron_pipette.cost.schedules import InFlight, schedule_for
from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.job import Job
from megatron_pipette.spec.layer_profile import LayerProfile
from megatron_pipette.spec.layout import DEFAULT_RECOMPUTE_MODULES
from megatron_pipette.spec.ranks import dense_grid, expert_grid
from megatron_pipette.spec.workload import BLOCK_SCALES, Workload, quantised_bytes
from megatron_pipette.units import GiB, MiB

TIGHT_HEADROOM = 0.02
"""A layout that fits by less than this fraction of the capacity fits within the memory model's own
error (docs/validation.md: counted activations 1.00-1.11x the prediction on CPU; the GPU's
allocator and NCCL are assumed): the plan says so instead of recommending it silently."""
UNFUSED_ATTENTION = ("unfused", "local")
"""--attention-backend values that materialise the s*s attention scores."""


def fp8_weight_copy_bytes(recipe: str, any_layout: bool = False) -> float:
    """Transformer Engine's FP8 copies of a linear's weight, per parameter: the weight and its
    transpose where the FP8 GEMMs take one operand layout (Hopper), the weight alone where they take
    either (`any_layout`, GPU.fp8_gemm_any_layout: Blackwell; Float8TensorStorage.update_usage
    keeps `_data` for both usages and drops `_transpose`), or under MXFP8, on any GPU, its rowwise
    copy (the forward GEMM's) and columnwise copy (the data gradient's), each with its E8M0 scales
    (linear.py: weightmat rowwise in the forward, weight_fp8.update_usage(columnwise_usage=True) in
    the backward): 2 (1), or 2 x 1.03125 bytes; NVFP4 likewise, its E2M1 halves and E4M3 scales (the
    weight quantised in 16x16 blocks, fp4_quant_fwd_weight, its scales kept per 16 in each
    direction): 2 x 0.5625 bytes."""
    copies = 1 if any_layout and recipe not in BLOCK_SCALES else 2
    return copies * quantised_bytes(recipe)


@dataclass(frozen=True, kw_only=True)
class RuntimeOverheads:
    """Memory outside the model's tensors, explicit so a user (or the probe) can override it."""

    cuda_context_bytes: int
    """Bytes: CUDA context plus cuBLAS/cuBLASLt/cuDNN workspaces, per device."""
    comm_buffer_bytes_per_group: int
    """Bytes: NCCL buffers of one communicator; a device pays it for every group it talks in."""
    fragmentation: float
    """Fraction of the dynamic (activation + transient) bytes the caching allocator loses."""
    nvls_bytes_per_local_rank: int = 200_000_000
    """Bytes: NCCL's NVLink SHARP buffers, per bulk communicator (Communicator.bulk), per rank it
    has in the device's NVLink domain (communicators with one such rank have none); only on
    clusters with NVLS on (Cluster.nvls); NCCL_NVLS_ENABLE=0 avoids it."""

    def __post_init__(self) -> None:
        for name in ("cuda_context_bytes", "comm_buffer_bytes_per_group", "nvls_bytes_per_local_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PipetteError(f"{name} must be a non-negative integer of bytes, got {value!r}")
        if not 0.0 <= self.fragmentation < 1.0:
            raise PipetteError(f"fragmentation must be in [0, 1), got {self.fragmentation!r}")


DEFAULT_FRAGMENTATION = 0.064
"""The caching allocator's loss without expandable segments, as a share of the dynamic bytes:
measured, max reserved less max allocated over the peak's growth above the model state, in two
Megatron training steps of a 1.3B GPT on an H200 (5.3% and 6.4%; the larger taken;
benchmarks/results/h200-2026-11-26-{cost-check,profiles}/train_megatron.log). An upper bound on what it
cannot give back: on a failed allocation the allocator frees its cached free segments and retries,
so only the free space inside segments that still hold live blocks is lost. One model, PP 1 and
Megatron's local spec: interleaved pipelines may lose more (docs/memory-model.md)."""
DEFAULT_OVERHEADS = RuntimeOverheads(cuda_context_bytes=1 * GiB, comm_buffer_bytes_per_group=512 * MiB,
                                     fragmentation=DEFAULT_FRAGMENTATION)
"""The context and NCCL terms assumed, not measured here (docs/memory-model.md, "Runtime
overheads"): a CUDA 12 context with lazy module loading takes 0.5-0.7 GiB on A100/H100, plus about
0.3 GiB of cuBLAS/TE/cuDNN workspaces; NCCL allocates NCCL_BUFFSIZE (4 MiB) Simple + ~4.5 MiB
LL128 + LL buffers per channel for its ring and tree connections, up to 32 channels on NVLink: about
0.5 GiB a communicator; NVLS allocates 2 x NCCL_BUFFSIZE per NVLS channel and local rank (nvls.cc:
nvlsPerRankSize x nHeads), reported at about 1.6 GB for a communicator of 8 GPUs, hence 200 MB a
local rank. Fragmentation measured (DEFAULT_FRAGMENTATION)."""
EXPANDABLE_SEGMENTS_FRAGMENTATION = 0.05
"""The allocator's loss with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (what NVIDIA's
Megatron-Bridge recipes set): freed blocks of a stream's one growing segment coalesce, so what is
lost is rounding to its 2 MiB pages and blocks pinned between live tensors. Assumed, not measured
(bound: a few percent, below the default allocator's measured DEFAULT_FRAGMENTATION)."""


def environment_overheads(env: Mapping[str, str]) -> RuntimeOverheads:
    """The overheads under the job's environment: PYTORCH_CUDA_ALLOC_CONF with expandable_segments:True
    loses less to fragmentation (EXPANDABLE_SEGMENTS_FRAGMENTATION)."""
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    if "expandable_segments:true" not in conf:
        return DEFAULT_OVERHEADS
    return dataclasses.replace(DEFAULT_OVERHEADS, fragmentation=EXPANDABLE_SEGMENTS_FRAGMENTATION)


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Peak bytes on one device of one pipeline rank, by kind."""

    stage: int
    """Pipeline rank, 0 .. PP-1."""
    parameters: int
    """Parameters on one device of this stage: its layers TP-sharded, plus the word/position
    embedding on stage 0, the output layer and final norm on the last stage."""
    weight_bytes: int
    """Bytes: parameters in the training dtype (2 for bf16/fp16, 4 for fp32), and under FP8 the
    layers' FP8 weight copies and transposes."""
    gradient_bytes: int
    """Bytes: the DDP gradient buffer (fp32 for bf16 and fp32 training, fp16 for fp16)."""
    optimizer_bytes: int
    """Bytes: Adam state (fp32 master copy, two moments), /DP with the distributed optimizer."""
    activation_bytes: int
    """Bytes: what the micro-batches (model chunks) in flight at the peak keep for their backward."""
    transient_bytes: int
    """Bytes: working memory at the peak: logits on the last stage, the recomputed layers under
    full recomputation, one layer's backward gradients, the attention-score/all-gather buffer."""
    overhead_bytes: int
    """Bytes: CUDA context, NCCL buffers and allocator fragmentation (RuntimeOverheads)."""
    step_bytes: int = 0
    """Bytes: what only the optimizer step holds, when no activation is alive: fp16's fp32 main
    gradients (/DP with the distributed optimizer)."""

    @property
    def total_bytes(self) -> int:
        """The peak: model state and overheads, plus the forward-backward's working set or the
        step's, whichever is larger."""
        return (self.weight_bytes + self.gradient_bytes + self.optimizer_bytes + self.overhead_bytes
                + max(self.activation_bytes + self.transient_bytes, self.step_bytes))


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Every stage's peak; a layout fits only if each one does."""

    stages: tuple[StageMemory, ...]
    """One entry per pipeline rank, in rank order."""
    capacity_bytes: int
    """Bytes: usable memory of one device (the catalog's memory_bytes)."""

    @property
    def worst_stage(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.worst_stage.total_bytes

    @property
    def fits(self) -> bool:
        return all(s.total_bytes <= self.capacity_bytes for s in self.stages)

    @property
    def headroom(self) -> float:
        """Capacity left on the fullest stage, as a fraction of the capacity."""
        return 1 - self.peak_bytes / self.capacity_bytes

    @property
    def tight(self) -> bool:
        """Fits, but by less than TIGHT_HEADROOM: within the memory model's own error."""
        return self.fits and self.headroom < TIGHT_HEADROOM


def state_bytes_per_parameter(workload: Workload) -> tuple[int, int, int, int]:
    """(weight, gradient, optimizer, step) bytes per parameter, unsharded; Megatron's
    distributed-optimizer table: bf16 2+4+12 = 18, fp16 2+2+12+4 = 20, fp32 4+4+8 = 16. fp16's 4
    are the fp32 main gradients, which exist only in the optimizer step: step() creates them
    (Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads: main_param.grad =
    main_grad.float(); the distributed optimizer per shard) and zero_grad(set_to_none=True), at the
    start of the next train_step, frees them before any forward. bf16 with --grad-reduce-in-bf16
    keeps bf16 gradient buffers, so it is fp16's case: 2+2+12+4. --use-precision-aware-optimizer
    keeps Adam's moments in their --*-dtype (Workload.optimizer_state_bytes) and, where
    Transformer Engine holds the master weights, steps on the gradient buffer without an fp32 copy
    (distrib_optimizer.py: decoupled_grad is a view; else shard_model_grad.float())."""
    if workload.precision == "fp32":
        return 4, 4, 8, 0
    weight, gradient = 2, workload.grad_bytes
    step = 0 if gradient == 4 or workload.te_holds_master_weights else 4
    return weight, gradient, workload.optimizer_state_bytes, step


def _attention_kept(workload: Workload) -> tuple[int, int, int, int]:
    """Per token, unsharded, what one layer's attention keeps for its backward: (training-dtype
    elements split over TP, the output projection's input (a linear's), training-dtype elements
    sharded only by SP, up-projection inputs sharded only by SP). Standard: Q, K and V (unfused
    attention stores K and V repeated to all heads) and, with --qk-layernorm, the query and key
    before their norms. MLA (megatron-core's MLASelfAttention): every head's assembled query and
    key and the values (megatron-core copies them out of the up projection's output, which is then
    freed: fused_apply_mla_rope_for_kv, or .contiguous() unfused), the down projections' outputs
    (the latents and the keys' rotary part, whole on every TP rank) and, with --qk-layernorm, the
    normed latents the up projections take in."""
    a, dq, dv = workload.num_attention_heads, workload.query_head_dim, workload.value_head_dim
    if not workload.multi_latent_attention:
        query = a * dq
        kv = query if workload.attention_backend in UNFUSED_ATTENTION else workload.query_groups * dq
        norms = (a + workload.query_groups) * dq if workload.qk_layernorm else 0
        return query + 2 * kv + norms, query, 0, 0
    latents = (workload.q_lora_rank or 0) + workload.kv_lora_rank
    return (2 * a * dq + a * dv, a * dv, latents + workload.qk_pos_emb_head_dim,
            latents if workload.qk_layernorm else 0)


def _fc1_width(workload: Workload) -> int:
    """fc1's output: SwiGLU's gate and up projections side by side."""
    return workload.fc1_widening * workload.ffn


def _score_elements(job: Job) -> int:
    """Elements of one layer's a*s*s attention scores on one device; flash/fused attention has none."""
    workload, layout = job.workload, job.layout
    if workload.attention_backend not in UNFUSED_ATTENTION:
        return 0
    return workload.num_attention_heads * workload.seq_length ** 2 * layout.micro_batch_size // layout.tp


def _score_bytes(job: Job) -> int:
    """One layer's stored s*s terms: softmax output, and with attention dropout its mask and output."""
    e, dropout = job.workload.bytes_per_element, job.workload.attention_dropout > 0
    return _score_elements(job) * (e + dropout * (1 + e))


def _formula_layer_bytes(job: Job, granularity: str | None, moe: bool = False) -> int:
    workload, layout = job.workload, job.layout
    h, e = workload.hidden_size, workload.bytes_per_element
    tokens, t = job.tokens_per_microbatch, layout.tp          # the rank's context-parallel share
    sp = t if layout.sequence_parallel else 1
    if granularity == "full":
        return e * tokens * h // sp  # the checkpointed layer's input
    redone = layout.selective_modules if granularity == "selective" else frozenset()
    masks = 2 if workload.hidden_dropout > 0 else 0
    lin = fp8_input_bytes(workload)       # what a linear keeps of its input: 1 byte under FP8 (+ scales)
    # What enters the MLP half: fc1's input, or the router's (e); a checkpointed dense MLP keeps its
    # input in the training dtype; the MoE layer's pre-MLP norm (never fused into a linear) is
    # redone under layernorm. A dense layer's norms are taken as kept: Transformer Engine fuses
    # them into QKV and fc1, where --recompute-modules layernorm redoes nothing.
    mlp_in = (0 if "layernorm" in redone else e) if moe else (e if "mlp" in redone else lin)
    # Norm inputs (2 x e), QKV's input, the MLP's input and the two hidden-dropout masks: sharded
    # only by SP.
    norm_side = tokens * h * (2 * e + lin + mlp_in + masks) // sp
    kept, proj_in, latents, latent_in = _attention_kept(workload)
    if "mla_up_proj" in redone:   # the up projections' query, key and value are discarded and redone
        kept = 0
    norm_side += tokens * (e * latents + lin * latent_in) // sp
    # Q, K, V, the output projection's input, fc1's output and fc2's input: sharded by TP; an MoE
    # layer's MLP keeps what cost.experts.moe_activation_bytes counts instead.
    if moe:
        mlp = moe_activation_bytes(job, redone)
    else:
        mlp = 0 if "mlp" in redone else tokens * (e * _fc1_width(workload) + lin * workload.ffn) // t
    tp_side = tokens * (e * kept + attention_output_bytes(workload) * proj_in) // t + mlp
    scores = 0 if "core_attn" in redone else _score_bytes(job)
    return round(norm_side + tp_side + scores)       # MXFP8's block scales make fractional bytes


def attention_output_bytes(workload: Workload) -> int:
    """Bytes per element kept of the attention's output, the output projection's input: a linear's
    copy (FP8: 1 byte). Under FP8 a fused or flash kernel keeps its 16-bit output for its own
    backward as well, and megatron-core lets the projection reuse it (save_original_input) except
    under delayed scaling, which keeps both (attention.py; Transformer Engine rejects the reuse with
    its delayed-scaling quantizer); so under MXFP8 and NVFP4 (--fp4-format) as under tensorwise."""
    lin, recipe = fp8_input_bytes(workload), workload.quantisation_recipe
    if recipe is None or workload.attention_backend in UNFUSED_ATTENTION:
        return lin
    return workload.bytes_per_element + (lin if recipe == "delayed" else 0)


def activation_bytes_per_layer(job: Job) -> int:
    """Bytes one transformer layer keeps for its backward, one micro-batch, one device, under the
    layout's recompute granularity ("full": the layer's checkpointed input). Korthikanti et al.
    2022 generalised; docs/memory-model.md derives it."""
    return _formula_layer_bytes(job, job.layout.recompute_granularity)


def _layer_bytes(job: Job, granularity: str | None, profile: LayerProfile | None, moe: bool = False) -> int:
    """Measured bytes when the profile has this shape (a dense layer over the rank's tokens), else the formula."""
    layout = job.layout
    entry = profile.layer(layout.tp, layout.micro_batch_size, layout.sequence_parallel, granularity, layout.cp) \
        if profile is not None and not moe and profile.covers(job) else None
    return entry.activation_bytes if entry is not None else _formula_layer_bytes(job, granularity, moe)


# In-flight micro-batches, as megatron-core 0.19's schedules run them (cost.schedules).

def microbatches_in_flight(pp: int, rank: int, num_microbatches: int, vpp: int = 1) -> int:
    """Model chunks (micro-batch x chunk) whose activations pipeline rank `rank` holds at its peak
    under the schedule Megatron runs (Schedule.microbatches_in_flight), with or without
    --overlap-moe-expert-parallel-comm (paired_steps: one layer more in its paired steps).

    Example: PP 4, 8 micro-batches: ranks hold 4, 3, 2, 1; interleaved with 2 chunks: 11, 9, 7, 5
    (warmup (4-r-1)*2 + (2-1)*4, plus one).
    """
    return schedule_for(pp, vpp).microbatches_in_flight(pp, rank, num_microbatches, vpp)


def extra_warmup(job: Job) -> int:
    """Forwards --overlap-moe-expert-parallel-comm adds before the first backward (its combined 1F1B
    runs one forward alone first, so that each later forward pairs with an independent backward)."""
    return 1 if job.layout.overlap_moe_expert_parallel_comm else 0


def paired_steps(job: Job, stage: int) -> bool:
    """Whether the stage runs combined 1F1B steps (--overlap-moe-expert-parallel-comm), each a
    forward beside an earlier chunk's backward, layer by layer: forward layer i beside backward
    layer L-1-i, whose state is released after it (megatron-core's
    TransformerModelChunkSchedulePlan.run, combined_1f1b.py). The backward chunk frees a layer as
    the forward chunk stores one, so the chunks held are the warmup's (one more forward than
    without the overlap, standing for the one before each backward) and, during the step, one layer
    more: the forward's layer i stored while the backward's layer L-1-i is still held. None where
    the warmup is every forward."""
    pp, m, v = job.layout.pp, job.num_microbatches, job.virtual_stages
    return schedule_for(pp, v).warmup_microbatches(pp, stage, m, v, extra_warmup(job)) < m * v \
        if extra_warmup(job) else False


def in_flight_microbatches(job: Job) -> tuple[int, ...]:
    """microbatches_in_flight of every pipeline rank of this job."""
    pp = job.layout.pp
    return tuple(microbatches_in_flight(pp, r, job.num_microbatches, job.virtual_stages) for r in range(pp))


# Module-level memo (cost.model lists them): a function of the schedule's integers alone.
@cache
def _in_flight_states(pp: int, rank: int, num_microbatches: int, vpp: int) -> frozenset[InFlight]:
    """(chunks in flight, of them chunk 0, of them the last chunk) after each forward step, as the
    schedule Megatron runs holds them (Schedule.in_flight_states); the combined 1F1B's paired steps
    hold the same chunks (paired_steps)."""
    schedule = schedule_for(pp, vpp)
    return schedule.in_flight_states(pp, rank, num_microbatches, vpp,
                                     schedule.warmup_microbatches(pp, rank, num_microbatches, vpp))


# Module-level memo (cost.model lists them): a function of the schedule's integers alone.
@cache
def _peak_candidates(pp: int, rank: int, num_microbatches: int, vpp: int) -> tuple[InFlight, ...]:
    """The in-flight states (chunks, of them chunk 0, of them the last chunk) no other state
    matches or exceeds in each of chunk 0's count, the last chunk's and the other chunks': a peak of
    bytes that grow with each of those (each chunk kind its own bytes) is always among them."""
    states = _in_flight_states(pp, rank, num_microbatches, vpp)
    kinds = {s: (s.chunks - s.first_chunk - s.last_chunk, s.first_chunk, s.last_chunk) if vpp > 1 else s
             for s in states}
    return tuple(a for a in states
                 if not any(b != a and all(x <= y for x, y in zip(kinds[a], kinds[b], strict=True)) for b in states))


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a device uses."""

    group: str
    """Megatron's group, named as its order strings name it (spec.ranks): tp, cp, pp, dp (dp-cp
    under context parallelism), mp (model parallel: tp-pp), ep, etp, etp-ep, edp, and embedding,
    world, grad-stats."""
    bulk: bool
    """It moves large tensors by collectives (TP activations, DP gradients and parameters, the
    embedding gradient), which NCCL runs with NVLS where it is on. pp runs p2p only, which NVLS
    does not serve; mp, world and grad-stats reduce a few bytes, which stay on the low-latency
    ring/tree protocols (NVLS has only the simple one), and NCCL sets NVLS up on first use
    (NCCL_RUNTIME_CONNECT, the default since 2.22)."""
    local_ranks: int
    """Its ranks in the device's NVLink domain, in Megatron's default rank order."""


def communicators(job: Job, stage: int, domain: int = 1) -> tuple[Communicator, ...]:
    """NCCL communicators a device of this stage uses (`domain`: GPUs per NVLink domain): TP, CP,
    PP, DP (the data x context parallel group with CP, which reduces the dense gradients), the
    model-parallel group (megatron/training/training.py: logical_and / reduce_max across it every
    step), the world group (barriers, timers), with the distributed optimizer its grad-stats group
    (core/optimizer/__init__.py: intra_dist_opt_group, every rank of a single optimizer instance,
    a communicator of its own), for an embedding copied to the last stage (tied, or for MTP) the
    embedding group on the first and last stages, and for an MoE model the expert groups its dispatcher and expert
    gradients use (EP, ETP, expert DP; ETP x EP for the allgather dispatcher). NCCL allocates a
    communicator's buffers on first use, so groups Megatron creates but never uses are not counted."""
    layout, workload = job.layout, job.workload
    tied_split = job.embedding_on_last_stage
    dispatcher = workload.moe_token_dispatcher_type if workload.num_experts is not None else None
    return _communicators(layout.tp, layout.cp, layout.dp, layout.pp, layout.ep, layout.etp, dispatcher,
                          layout.cp_comm_type, stage, tied_split, layout.use_distributed_optimizer, domain)


# Module-level memo (cost.model lists them): a function of the rank grid's sizes alone.
@lru_cache(maxsize=4096)
def _communicators(tp: int, cp: int, dp: int, pp: int, ep: int, etp: int, dispatcher: str | None, cp_comm: str,
                   stage: int, tied_split: bool, distributed_optimizer: bool, domain: int) -> tuple[Communicator, ...]:
    dense = dense_grid(tp=tp, cp=cp, dp=dp, pp=pp)
    world, device = dense.world_size, dense.rank(pp=stage)      # rank 0 of every group axis of this stage

    def group(name: str, ranks: np.ndarray, bulk: bool) -> Communicator:
        local = int(np.count_nonzero(ranks // domain == device // domain))
        return Communicator(group=name, bulk=bulk, local_ranks=local)

    comms = []
    if tp > 1:
        comms.append(group("tp", dense.group_of(device, "tp"), bulk=True))
    if cp > 1:   # the p2p ring's sends and receives are not NVLS collectives
        comms.append(group("cp", dense.group_of(device, "cp"), bulk=cp_comm != "p2p"))
    if pp > 1:
        comms.append(group("pp", dense.group_of(device, "pp"), bulk=False))
    if dp * cp > 1:
        comms.append(group("dp" if cp == 1 else "dp-cp", dense.group_of(device, "dp-cp"), bulk=True))
    if tp * pp > 1:
        comms.append(group("mp", dense.group_of(device, "tp-pp"), bulk=False))
    if dispatcher is not None:
        experts = expert_grid(world, etp=etp, ep=ep, pp=pp)
        if dispatcher == "alltoall":    # all-to-alls are point-to-point inside NCCL: no NVLS
            comms += [group("ep", experts.group_of(device, "ep"), bulk=False)] if ep > 1 else []
            comms += [group("etp", experts.group_of(device, "etp"), bulk=True)] if etp > 1 else []
        elif ep * etp > 1:
            comms.append(group("etp-ep", experts.group_of(device, "etp-ep"), bulk=True))
        if experts.size("edp") > 1:
            comms.append(group("edp", experts.group_of(device, "edp"), bulk=True))
    if world > 1:
        everyone = Communicator(group="world", bulk=False, local_ranks=min(world, domain))
        comms.append(everyone)
        if distributed_optimizer:
            comms.append(Communicator(group="grad-stats", bulk=False, local_ranks=everyone.local_ranks))
    if tied_split and stage in (0, pp - 1):   # the first and last stages of this device's pipeline
        comms.append(group("embedding", dense.group_of(device, "pp")[[0, -1]], bulk=True))
    return tuple(comms)


def nccl_bytes(job: Job, stage: int, overheads: RuntimeOverheads, nvls_domain: int) -> int:
    """NCCL's buffers on a device of this stage: each communicator's, plus NVLS buffers in the bulk
    ones with two or more ranks in one NVLink domain (`nvls_domain`: GPUs per domain where NVLS is
    on, 0 where off)."""
    comms = communicators(job, stage, max(nvls_domain, 1))
    nvls = sum(c.local_ranks for c in comms if nvls_domain and c.bulk and c.local_ranks > 1)
    return len(comms) * overheads.comm_buffer_bytes_per_group + nvls * overheads.nvls_bytes_per_local_rank


# The estimate.

class ChunkActivations(NamedTuple):
    """Activation bytes of one micro-batch in one model chunk."""

    stored: int
    """Kept from its forward to its backward."""
    recomputed: int
    """Rematerialised at once in its backward."""
    layer: int
    """Its heaviest layer's stored bytes (under full recomputation an upper bound: the layer whole)."""


def chunk_stored_bytes(job: Job, chunk_layers: int, moe_layers: int) -> int:
    """Bytes one micro-batch keeps for its backward in a chunk of `chunk_layers` layers, `moe_layers`
    of them MoE (the formula's: what cost.offload copies to the host)."""
    return _chunk_activations(job, chunk_layers, moe_layers, None).stored


def _chunk_activations(job: Job, chunk_layers: int, moe_layers: int,
                       profile: LayerProfile | None) -> ChunkActivations:
    """One micro-batch's activations in one model chunk of `chunk_layers` layers, `moe_layers` of
    them MoE."""
    layout = job.layout
    granularity = layout.recompute_granularity
    dense = chunk_layers - moe_layers
    if granularity != "full":
        dense_layer = _layer_bytes(job, granularity, profile) if dense else 0
        moe_layer = _layer_bytes(job, granularity, profile, moe=True) if moe_layers else 0
        stored, layer = dense * dense_layer + moe_layers * moe_layer, max(dense_layer, moe_layer)
        if granularity is None:
            return ChunkActivations(stored=stored, recomputed=0, layer=layer)
        # A layer's backward rematerialises what selective recomputation dropped, one layer at a time:
        # by default (core_attn) its scores; else what the formula drops, for the heavier kind of layer.
        if layout.selective_modules == DEFAULT_RECOMPUTE_MODULES:
            return ChunkActivations(stored=stored, recomputed=_score_bytes(job), layer=layer)
        kinds = [False] * (dense > 0) + [True] * (moe_layers > 0)
        return ChunkActivations(stored=stored, recomputed=max(
            (_formula_layer_bytes(job, None, moe) - _formula_layer_bytes(job, granularity, moe) for moe in kinds),
            default=0), layer=layer)
    stored = _layer_bytes(job, "full", profile)
    full_dense = _layer_bytes(job, None, profile)
    full_moe = _layer_bytes(job, None, profile, moe=True) if moe_layers else 0
    full = max(full_dense, full_moe)
    n = layout.recompute_num_layers
    if layout.recompute_method == "uniform":  # inputs of groups of n layers; one group live in backward
        return ChunkActivations(stored=-(-chunk_layers // n) * stored, recomputed=min(n, chunk_layers) * full,
                                layer=full)
    checkpointed = min(n, chunk_layers)  # block: the first n layers of each chunk, one at a time
    kept_moe = min(moe_layers, chunk_layers - checkpointed)   # the heavier layers taken as the kept ones
    kept = (chunk_layers - checkpointed - kept_moe) * full_dense + kept_moe * full_moe
    return ChunkActivations(stored=checkpointed * stored + kept, recomputed=full, layer=full)


@dataclass(frozen=True)
class _JobTerms:
    """What every stage of one job shares (_stage_memory adds what differs by stage)."""

    embedding: int
    """Stage 0, chunk 0: the embedding's dropout mask."""
    output: int
    """Last stage, last chunk: the final norm's and output layer's inputs, and what the
    vocab-parallel cross entropy saves (loss_kept_bytes)."""
    buffer: int
    """Megatron's "mpu" buffer: the unfused attention's score matrix, or the SP all-gathered input."""
    dense_backward: int
    """One layer's gradients in flight in a stage without MoE layers: the MLP's two wide ones, or
    the score gradients."""
    moe_backward: int
    """The same in a stage with MoE layers (an MoE layer's experts', with the dispatcher's send and
    receive buffers of the routed rows, or of HybridEP's budget)."""
    logits: int
    """The last stage's training-dtype logits (forward) or their gradient (backward); fp32 logits
    are the softmax."""


def loss_kept_bytes(workload: Workload) -> int:
    """Bytes per logit the vocab-parallel cross entropy keeps for its backward: megatron-core's plain
    and native fused ones (tensor_parallel/cross_entropy.py, fusions/fused_cross_entropy.py) save the
    fp32 softmax (`exp_logits`, after `.float()`), 4; Transformer Engine's (--cross-entropy-fusion-impl
    te with --cross-entropy-loss-fusion; TE 2.20's CrossEntropyFunction saves `saved_input`, a copy of
    the logits in their own dtype, and two fp32 statistics per row) keeps the logits' e bytes."""
    return workload.bytes_per_element if workload.cross_entropy_fusion == "te" else 4


def _job_terms(job: Job) -> _JobTerms:
    workload, layout = job.workload, job.layout
    e, t, h = workload.bytes_per_element, layout.tp, workload.hidden_size
    tokens = job.tokens_per_microbatch
    sp = t if layout.sequence_parallel else 1
    vocab = workload.padded_vocab_size(t)
    scores = _score_elements(job)
    dense = max(e * tokens * (_fc1_width(workload) + workload.ffn) // t, 2 * e * scores)
    moe = max(dense, moe_backward_bytes(job) + 2 * e * round(buffer_rows(job)) * h) if job.moe_layers else dense
    return _JobTerms(embedding=tokens * h // sp if workload.hidden_dropout > 0 else 0,
                     output=2 * e * tokens * h // sp + loss_kept_bytes(workload) * tokens * vocab // t,
                     buffer=max(e * scores, e * tokens * h if layout.sequence_parallel else 0),
                     dense_backward=dense, moe_backward=moe, logits=e * tokens * vocab // t if e != 4 else 0)


def _mtp_activations(job: Job, terms: _JobTerms, profile: LayerProfile | None) -> int:
    """One micro-batch's activations of the MTP layers, which follow the loss's chunk's layers:
    each a layer of the last decoder layer's kind, the norms' inputs (the embedding and the hidden
    state) and the projection's concatenated input, its embedding's dropout mask and its own
    output and loss; under full recomputation the checkpoint keeps its two inputs instead of the
    layer and projection (MultiTokenPredictionLayer._checkpointed_forward)."""
    w, layout = job.workload, job.layout
    if not w.mtp_layers:
        return 0
    e, n, h = w.bytes_per_element, job.tokens_per_microbatch, w.hidden_size
    sp = layout.tp if layout.sequence_parallel else 1
    if layout.recompute_granularity == "full":
        layer = 2 * e * n * h // sp
    else:
        layer = (_layer_bytes(job, layout.recompute_granularity, profile, moe=w.mtp_layer_is_moe)
                 + (2 * e + 2 * fp8_input_bytes(w)) * n * h // sp)
    return round(w.mtp_layers * (layer + terms.embedding + terms.output))


def _stage_memory(job: Job, stage: int, params: StageParameters, terms: _JobTerms, chunk_bytes,
                  overheads: RuntimeOverheads, nvls_domain: int, mtp: int, fp8_any_layout: bool) -> StageMemory:
    workload, layout = job.workload, job.layout
    first, last = stage == 0, stage == layout.pp - 1
    vpp = job.virtual_stages
    moe = job.moe_layers[stage] if job.moe_layers else (0,) * vpp
    # Under --cpu-offloading-num-layers a chunk holds L - N layers' activations at most (cost.offload),
    # the heavier (MoE) ones among them.
    resident = [resident_layers(job, n) for n in job.chunk_sizes[stage]]
    chunks = [chunk_bytes(n, min(m, n)) for n, m in zip(resident, moe)]
    recomputed = max(c.recomputed for c in chunks)
    embedding = terms.embedding if first else 0
    output = terms.output + mtp if last else 0
    states = _peak_candidates(layout.pp, stage, job.num_microbatches, vpp)
    if vpp > 1 and (first or last):
        # The end ranks' states count chunk 0 and the last chunk apart: each weighs its own layers
        # (the embedding or the loss counted in the split shortens it, sometimes to none), the rest
        # the heaviest middle chunk.
        head, tail = chunks[0].stored + embedding, chunks[-1].stored + output
        middle = max((c.stored for c in chunks[1:-1]), default=0)
        activations = max((n - n_first - n_last) * middle + n_first * head + n_last * tail
                          for n, n_first, n_last in states)
    else:   # one chunk, or a middle rank: the heaviest chunk (by its layers, MoE among them) for all
        chunk = max(c.stored for c in chunks)
        activations = max(n * chunk + n_first * embedding + n_last * output for n, n_first, n_last in states)
    backward = terms.moe_backward if any(moe) else terms.dense_backward
    # A combined 1F1B step's forward layer, stored while the backward's layer is still held
    # (paired_steps): the heavier kind of layer the stage has.
    paired = max(c.layer for c in chunks) if paired_steps(job, stage) else 0
    transient = terms.buffer + max(terms.logits if last else 0, recomputed + backward + paired)

    dense, expert = int(params.dense[stage]), int(params.expert[stage])
    weight, gradient, optimizer, step = state_bytes_per_parameter(workload)
    # The distributed optimizer shards dense state over data x context parallel, experts' over expert DP.
    dense_shards, expert_shards = (layout.dp * layout.cp, layout.expert_data_parallel_size) \
        if layout.use_distributed_optimizer else (1, 1)

    def sharded(per_parameter: int) -> int:
        return -(-per_parameter * dense // dense_shards) - (-per_parameter * expert // expert_shards)

    overhead = (overheads.cuda_context_bytes + nccl_bytes(job, stage, overheads, nvls_domain)
                + round(overheads.fragmentation * (activations + transient)))
    # Under FP8, Transformer Engine keeps each layer linear's FP8 weight copies (fp8_weight_copy_bytes)
    # from the first micro-batch on. With --fp8-param-gather those are the weights (FP8 primary
    # weights and, on Hopper, their cached transpose, or MXFP8's two copies; --fp4-param-gather NVFP4's two):
    # the 16-bit copy is gone. Under
    # MXFP8 it needs --reuse-grad-buf-for-mxfp8-param-ag, which gathers the 16-bit weights into the
    # gradient buffer (param_and_grad_buffer.py, shared_buffer): no parameter buffer is added.
    layer_linears = int(params.dense_in_layers[stage]) + expert
    recipe = workload.quantisation_recipe
    fp8_copies = round(fp8_weight_copy_bytes(recipe, fp8_any_layout) * layer_linears) if recipe else 0
    if workload.keeps_quantised_weights:
        fp8_copies -= weight * layer_linears
    weights, gradients = weight * (dense + expert) + fp8_copies, gradient * (dense + expert)
    if layout.use_megatron_fsdp:      # sharded as its strategy says, a few layers held whole
        weights, gradients = held_state(job, stage, params, weights, gradients, weight, gradient)
    return StageMemory(stage=stage, parameters=dense + expert, weight_bytes=weights,
                       gradient_bytes=gradients, optimizer_bytes=sharded(optimizer),
                       activation_bytes=activations, transient_bytes=transient, overhead_bytes=overhead,
                       step_bytes=sharded(step))


def estimate_memory(job: Job, capacity_bytes: int, *, profile: LayerProfile | None = None,
                    overheads: RuntimeOverheads = DEFAULT_OVERHEADS, nvls_domain: int = 0,
                    fp8_any_layout: bool = False) -> MemoryEstimate:
    """Peak memory of every pipeline stage of a (valid, resolved) job.

    `profile` replaces the per-layer activation formula where it has the (TP, micro-batch, SP,
    recompute) shape; the caller checks it belongs to this model (check_profile_matches).
    `nvls_domain`: GPUs per NVLink domain where NCCL's NVLS is on (Cluster.nvls), else 0.
    `fp8_any_layout`: the GPU's FP8 GEMMs take either operand layout (GPU.fp8_gemm_any_layout).
    """
    if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes <= 0:
        raise PipetteError(f"device memory capacity must be a positive number of bytes, got {capacity_bytes!r}")
    params = stage_parameters(job)
    terms = _job_terms(job)
    chunk_bytes = cache(lambda n, m: _chunk_activations(job, n, m, profile))     # stages share chunks
    mtp = _mtp_activations(job, terms, profile)
    stages = tuple(_stage_memory(job, r, params, terms, chunk_bytes, overheads, nvls_domain, mtp, fp8_any_layout)
                   for r in range(job.layout.pp))
    return MemoryEstimate(stages=stages, capacity_bytes=capacity_bytes)


def misfit_reason(estimate: MemoryEstimate) -> str | None:
    """Why the estimate does not fit, naming the worst stage and its breakdown in GiB (None: it fits)."""
    if estimate.fits:
        return None
    s = estimate.worst_stage
    parts = (("weights", s.weight_bytes), ("gradients", s.gradient_bytes), ("optimizer", s.optimizer_bytes),
             ("activations", s.activation_bytes), ("transient", s.transient_bytes), ("overheads", s.overhead_bytes))
    if s.step_bytes:
        parts += (("in the step, in place of activations and transient", s.step_bytes),)
    detail = ", ".join(f"{name} {value / GiB:.1f} GiB" for name, value in parts)
    return f"stage {s.stage} needs {s.total_bytes / GiB:.1f} GiB of {estimate.capacity_bytes / GiB:.1f} GiB ({detail})"
