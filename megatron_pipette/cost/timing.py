"""Iteration time of one layout on one cluster under one rank placement.

Per data-parallel replica, each pipeline stage's forward and backward time
per micro-batch is its compute (`cost.compute`, at its TP group's slowest
device) plus its tensor-parallel collectives on that group's own links; the
pipeline schedule (`cost.schedules`) turns them, with each hop's p2p time, into
the replica's forward-backward time and each stage's finish. Then, per stage,
the data-parallel gradient reduction on that stage's own DP groups (it starts
when the stage has finished in every replica), the tied-embedding all-reduce
between the first and last stage, and the optimizer step.

The breakdown attributes the critical replica's pipeline time to the stage
that is busiest in it (its compute, recomputation, TP and p2p time, summed
over micro-batches); what is left is the bubble. Everything after the
pipeline is attributed to the step that ends last. docs/time-model.md has the
formulas and the Megatron behaviour they follow.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import NamedTuple

import numpy as np

from megatron_pipette.cost import fsdp, offload, schedules, simulator
from megatron_pipette.cost.comm import GroupLinks, Rings
from megatron_pipette.cost.compute import StageWork, attention_input_width
from megatron_pipette.cost.execution import DEFAULT_EXECUTION, Execution
from megatron_pipette.cost.experts import dispatch_bytes, flex_shares
from megatron_pipette.cost.launch import moe_layer_graphed
from megatron_pipette.cost.memory import chunk_stored_bytes, extra_warmup
from megatron_pipette.cost.parameters import StageParameters, stage_parameters, word_embedding_per_rank
from megatron_pipette.errors import Infeasible
from megatron_pipette.spec.hardware import Cluster
from megatron_pipette.spec.job import Job
from megatron_pipette.spec.workload import Workload, quantised_bytes


def optimizer_bytes_per_param(workload: Workload) -> int:
    """Memory traffic of one mixed-precision Adam step per parameter: the master weights and both
    moments read and written (24 in fp32), the gradient read for the norm, the clip scale and the
    update (12 in fp32), the 16-bit model param written (2) and the grad buffer zeroed (2,
    amortised): 40 by default, less with the precision-aware optimizer's narrower state."""
    return 2 * workload.optimizer_state_bytes + 3 * workload.grad_bytes + 2 * workload.bytes_per_element


DDP_MIN_BUCKET_PARAMS = 40_000_000
"""Megatron's default bucket: max(40M, 1M x DP) parameters, first pipeline stage only."""


@dataclass(frozen=True, kw_only=True)
class TimeBreakdown:
    """Seconds on the critical path of one iteration; the fields sum to the iteration time."""

    compute_s: float
    """Forward and backward compute of the busiest stage of the slowest replica, all micro-batches."""
    recompute_s: float
    """Recomputed forward compute of that stage."""
    tp_comm_s: float
    """Tensor-parallel collectives of that stage (recomputed ones included)."""
    cp_comm_s: float = 0.0
    """Context-parallel key/value exchange of that stage not hidden behind its attention."""
    ep_comm_s: float = 0.0
    """That stage's MoE token dispatch and combine (expert-parallel all-to-alls, expert-TP
    all-gathers and reduce-scatters)."""
    pp_comm_s: float
    """That stage's p2p sends and receives."""
    pipeline_bubble_s: float
    """The rest of the forward-backward pass: warmup, cooldown and waiting on other stages (and the
    --cpu-offloading-num-layers copies' exposed part, cost.offload)."""
    dp_comm_exposed_s: float
    """Data-parallel gradient reduction (and parameter all-gather) not hidden behind compute; under
    Megatron-FSDP its layer gathers and reduce-scatters of every micro-batch (cost.fsdp) included."""
    embedding_allreduce_s: float
    """Tied word-embedding gradient all-reduce between the first and last stage."""
    optimizer_s: float
    """The optimizer step (memory bound)."""

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class StageTime(NamedTuple):
    """A NamedTuple rather than a dataclass so reports may unpack (forward_s, backward_s)."""

    forward_s: float
    """Forward time of one micro-batch on this pipeline rank (all its chunks), worst replica."""
    backward_s: float
    """Backward time of one micro-batch (recomputation included), worst replica."""


@dataclass(frozen=True, kw_only=True)
class TimeEstimate:
    iteration_time_s: float
    """Predicted seconds per training iteration."""
    tflops_per_gpu: float
    """Model FLOPs per iteration / time / GPUs, in TFLOP/s (Megatron's MFU convention)."""
    breakdown: TimeBreakdown
    stage_times: tuple[StageTime, ...]
    """Per pipeline rank, for reports."""
    schedule: str = "1f1b"
    """The pipeline schedule Megatron runs for this layout."""
    exact_schedule: bool = True
    """False when some replica's interleaved schedule time was extrapolated (cost.interleaved);
    the simulator's answer otherwise."""
    extrapolations: tuple[str, ...] = ()
    """What the layer profile was used for beyond what it measured (StageWork.extrapolations), a line each."""


@dataclass(frozen=True, kw_only=True)
class _Stages:
    """Per-replica stage times and their parts, (dp, pp, v)."""

    times: schedules.StageTimes
    compute: np.ndarray
    recompute: np.ndarray
    tp_comm: np.ndarray
    cp_comm: np.ndarray
    ep_comm: np.ndarray
    dp_comm: np.ndarray
    """Megatron-FSDP's layer gathers and reduce-scatters not hidden (cost.fsdp), zeros without it."""


def behind_gemms(collective_s: np.ndarray, gemm_flops: np.ndarray | float, rate: np.ndarray,
                 share: float = 0.0) -> np.ndarray:
    """Seconds collectives that each run behind one GEMM (`gemm_flops`, effective: one GEMM's, or
    several on the last axis; `rate` FLOP/s) add: the part the GEMM cannot hide, max(0, collective -
    GEMM), and the `share` of the GEMM's throughput the collective takes while it runs beside it
    (Execution.nccl_compute_share)."""
    c, g = collective_s[..., None], gemm_flops / rate[..., None]
    return (np.maximum(0.0, c - g) + share * np.minimum(c, g)).sum(axis=-1)


def userbuffer_exposed(collective_s: np.ndarray, gemm_flops: np.ndarray | float, rate: np.ndarray, tp: int,
                       share: float = 0.0) -> np.ndarray:
    """Exposed seconds of collectives each pipelined with one GEMM in TP chunks (Transformer
    Engine's userbuffers, --tp-comm-overlap): a pair takes max(c, g) + min(c, g) / TP (the chunk
    that cannot overlap), so max(0, c - g) + min(c, g) / TP shows beyond the GEMM. Assumed, not
    measured; the overlapped part takes `share` of the GEMM's throughput, as in behind_gemms."""
    c, g = collective_s[..., None], gemm_flops / rate[..., None]
    return (np.maximum(0.0, c - g) + (1 / tp + share) * np.minimum(c, g)).sum(axis=-1)


def _context_parallel(job: Job, work: StageWork, links: GroupLinks, rate: np.ndarray,
                      share: float) -> tuple[np.ndarray, ...]:
    """Exposed (forward, backward) seconds of one layer's context-parallel exchange, (dp x cp, pp, 1).

    p2p (Transformer Engine's ring, AttnFuncWithCPAndKVP2P): CP - 1 steps each pass a K/V block to
    the next rank while the attention of the block in hand runs, so only what the attention of
    CP - 1 blocks cannot cover shows; the backward passes the K/V gradients along too. a2a
    (Ulysses): all-to-alls of Q, K, V and the output, each way, in the open. allgather: K and V
    all-gathered (and their gradients reduce-scattered back), in the open."""
    w, layout = job.workload, job.layout
    n, e, dq, dv = job.tokens_per_microbatch, w.bytes_per_element, w.query_head_dim, w.value_head_dim
    heads, groups = w.num_attention_heads // layout.tp, w.query_groups // layout.tp
    kv = n * groups * (dq + dv) * e                                          # this rank's K and V
    if layout.cp_comm_type == "a2a":
        a2a = links.cp_a2a_groups
        one = sum(a2a.all_to_all_s(n * width * e) for width in (heads * dq, groups * dq, groups * dv, heads * dv))
        return one.T[:, :, None], one.T[:, :, None]
    ring = links.cp_groups
    gather = ring.all_gather_s(layout.cp * kv).T[:, :, None]
    if layout.cp_comm_type == "allgather":
        return gather, 2 * gather
    blocks = (layout.cp - 1) / layout.cp                   # the attention of CP - 1 blocks hides the ring
    core = work.attention_core
    return (behind_gemms(gather, blocks * core.forward, rate, share),
            behind_gemms(2 * gather, blocks * core.backward, rate, share))


def _dispatch(job: Job, links: GroupLinks) -> np.ndarray:
    """(pp,) seconds of one MoE layer's dispatch and combine, one direction (cost.experts): the
    backward moves the same volumes the other way. Not overlapped with compute (Megatron's
    --overlap-moe-expert-parallel-comm, which would, is refused)."""
    volume, experts = dispatch_bytes(job), links.experts
    if job.workload.moe_token_dispatcher_type == "alltoall":
        return 2 * experts.dispatch.all_to_all_s(volume["a2a"]) + 2 * experts.etp_groups.all_gather_s(volume["etp"])
    if job.workload.moe_token_dispatcher_type == "flex":
        return 2 * experts.dispatch.all_to_all_s(volume["flex"], *flex_shares(job, experts.gpus_per_domain))
    return 2 * experts.etp_ep_groups.all_gather_s(volume["etp-ep"])


def _expert_overlap_saving(job: Job, work: StageWork, links: GroupLinks, rate: np.ndarray,
                           share: float) -> np.ndarray:
    """(dp, pp, 1) seconds one MoE layer saves where --overlap-moe-expert-parallel-comm runs its
    forward for one micro-batch together with its backward for another (megatron-core 0.19,
    TransformerLayerSchedulePlan.run), against running them one after the other:

        communication stream:  combine bwd     | dispatch fwd, dispatch bwd      | combine fwd
        compute stream:        pre-dispatch fwd | MLP bwd, (its wgrad), MLP fwd | pre-dispatch bwd

    each part starting when its stream is free and its input is ready: the MLP backward after the
    combine's backward, the dispatch's after the MLP's backward (and after its experts' weight
    gradients, unless --delay-wgrad-compute defers them), and so on. Pre-dispatch is the layer's work
    less its MLP (the attention with its norms); the MLP is the router, permutations and experts
    (cost.experts.moe_mlp). The time the two streams run together costs Execution's
    nccl_compute_share of it, as behind_gemms prices. The layer's fixed cost and its TP
    collectives stay as they are."""
    layer, mlp = work.moe_layer, work.moe_mlp
    wgrad = mlp.wgrad.seconds(rate) if job.layout.delay_wgrad_compute else 0.0
    pre_f = (layer.forward + mlp.forward.scaled(-1)).seconds(rate)
    pre_b = (layer.backward + layer.recompute + (mlp.backward + mlp.recompute).scaled(-1)).seconds(rate)
    mlp_f, mlp_b = mlp.forward.seconds(rate), (mlp.backward + mlp.recompute).seconds(rate) - wgrad
    a2a = _dispatch(job, links)[None, :, None] / 2           # a dispatch, or a combine, one direction
    start = np.maximum(pre_f, a2a)                              # the first column above
    dispatch_b_end = start + np.maximum(a2a, mlp_b) + a2a
    mlp_f_end = start + np.maximum(mlp_b + wgrad, a2a) + mlp_f
    together = np.maximum(mlp_f_end, dispatch_b_end) + np.maximum(a2a, pre_b)
    apart = pre_f + mlp_f + pre_b + mlp_b + wgrad + 4 * a2a
    return (1 - share) * (apart - together)


def _paired_share(job: Job) -> np.ndarray:
    """(pp, 1) share of a stage's forwards that run paired with a backward under
    --overlap-moe-expert-parallel-comm: all but its warmup, which the schedule lengthens by one
    forward (get_pp_rank_microbatches; without a pipeline the first forward runs alone)."""
    pp, m, v = job.layout.pp, job.num_microbatches, job.virtual_stages
    schedule = schedules.schedule_for(pp, v)
    warmup = [schedule.warmup_microbatches(pp, r, m, v, extra_warmup(job)) for r in range(pp)]
    return (1 - np.array(warmup, dtype=float) / (m * v))[:, None]


def _cross_entropy_comm(ring: Rings, tokens: int, fusion: str | None) -> np.ndarray:
    """The cross entropy's tensor-parallel collectives of fp32 per-token values: all-reduces of the
    max, then of the predicted logit and the sum of exponentials (native: both in one message); te
    all-gathers each rank's four statistics (max, sum, predicted logit, sum of logits) instead."""
    if fusion == "te":
        return ring.all_gather_s(16 * tokens * ring.size)
    return ring.all_reduce_s(4 * tokens) + (ring.all_reduce_s(8 * tokens) if fusion == "native"
                                            else 2 * ring.all_reduce_s(4 * tokens))


def _stage_times(job: Job, work: StageWork, links: GroupLinks, execution: Execution) -> _Stages:
    workload, layout = job.workload, job.layout
    sp = layout.sequence_parallel
    tokens = job.tokens_per_microbatch
    act = tokens * workload.hidden_size * workload.bytes_per_element
    ring = links.tp_groups
    ar, ag = ring.all_reduce_s(act).T[:, :, None], ring.all_gather_s(act).T[:, :, None]   # (dp, pp, 1)
    # The collective before the attention's column-parallel linears moves their input: the hidden
    # state, or MLA's latents (cost.compute.attention_input_width).
    attn_in = tokens * attention_input_width(workload) * workload.bytes_per_element
    ar_in, ag_in = (ar, ag) if attn_in == act else (ring.all_reduce_s(attn_in).T[:, :, None],
                                                    ring.all_gather_s(attn_in).T[:, :, None])
    # Under FP8 Transformer Engine all-gathers the column-parallel linears' inputs (QKV or MLA's up
    # projections, fc1) already quantised: 1 byte an element (layernorm_linear.py, linear.py:
    # gather_along_first_dim with the input quantizer), in the forward and in the backward's re-gather;
    # the block-scaled recipes' with their scales (quantised_bytes; NVFP4 half a byte and a scale per 16).
    if workload.quantisation_recipe is not None:
        quantised = quantised_bytes(workload.quantisation_recipe)
        ag_fc1 = ring.all_gather_s(quantised * tokens * workload.hidden_size).T[:, :, None]
        ag_qkv = ring.all_gather_s(quantised * attn_in / workload.bytes_per_element).T[:, :, None]
    else:
        ag_fc1, ag_qkv = ag, ag_in
    rate = links.gemm_flops.T[:, :, None]                                                  # (dp, pp, 1)
    # The column-parallel linears (QKV or MLA's up projections, fc1, the output layer) run their backward collectives
    # asynchronously (LinearWithGradAccumulationAndAsyncCommunication.backward): the input-gradient
    # all-reduce (SP: reduce-scatter) behind the weight-gradient GEMM and, with SP, the input
    # re-gather behind the data-gradient GEMM. The rest is exposed: the row-parallel linears'
    # forward all-reduces (SP: reduce-scatters, and the all-gathers before QKV and fc1) and, with SP,
    # the all-gather of their output gradient in the backward.
    # With --tp-comm-overlap the exposed ones are pipelined with the GEMM beside them (userbuffers).
    qkv, proj, fc1, fc2, output = work.linears
    share = execution.nccl_compute_share

    def hidden(collective: np.ndarray, gemm_flops: np.ndarray | float) -> np.ndarray:
        return behind_gemms(collective, gemm_flops, rate, share)

    def pipelined(collective: np.ndarray, gemm_flops: np.ndarray | float) -> np.ndarray:
        return userbuffer_exposed(collective, gemm_flops, rate, layout.tp, share)

    if sp:
        if layout.tp_comm_overlap:
            forward_ag = pipelined(ag, np.array([qkv.forward, proj.forward, fc1.forward, fc2.forward]))
            mlp_ag = pipelined(ag, np.array([fc1.forward, fc2.forward]))
            layer_grad_ag = pipelined(ag, np.array([proj.dgrad, fc2.dgrad]))
            mlp_grad_ag = pipelined(ag, fc2.dgrad)
        else:
            # before QKV and fc1 the input all-gathers, after the projection and fc2 the reduce-scatters
            forward_ag, mlp_ag = ag_qkv + ag_fc1 + 2 * ag, ag_fc1 + ag
            layer_grad_ag, mlp_grad_ag = 2 * ag, ag
        layer_fwd = forward_ag
        # The input's re-gather behind the data-gradient GEMM, the input gradient's reduce-scatter
        # behind the weight-gradient GEMM.
        fc1_bwd = hidden(ag_fc1, fc1.dgrad) + hidden(ag, fc1.wgrad)
        layer_bwd = (layer_grad_ag + hidden(ag_qkv, qkv.dgrad) + hidden(ag_in, qkv.wgrad)
                     + fc1_bwd)
        mlp_fwd, mlp_bwd = mlp_ag, mlp_grad_ag + fc1_bwd
        output_bwd = hidden(ag, output.dgrad) + hidden(ag, output.wgrad)
    else:
        mlp_fwd, mlp_bwd = ar, hidden(ar, fc1.wgrad)
        layer_fwd, layer_bwd = 2 * ar, mlp_bwd + hidden(ar_in, qkv.wgrad)
        output_bwd = hidden(ar, output.wgrad)
    tp_f = layer_fwd * work.layers
    tp_b = layer_bwd * work.layers + layer_fwd * work.recomputed_layers + mlp_fwd * work.mlp_redone
    if sp and "mla_up_proj" in layout.selective_modules and layout.recompute_granularity == "selective":
        tp_b = tp_b + ag_qkv * work.layers     # the redone up projections gather their latents again
    if workload.moe_shared_expert_intermediate_size is None:   # no dense MLP in an MoE layer: no TP collectives
        tp_f = tp_f - mlp_fwd * work.moe_layers
        tp_b = tp_b - mlp_bwd * work.moe_layers - mlp_fwd * work.moe_recomputed
    ep_f = ep_b = np.zeros_like(tp_f)
    if work.moe_layers.any():
        # Dispatch and combine, and the layer's fixed cost (Execution.moe_layer_fixed_s: none where
        # CUDA graphs capture the layer, launch.moe_layer_graphed), in each direction; recomputed MoE
        # forwards pay them again in the backward.
        fixed = 0.0 if moe_layer_graphed(workload) else execution.moe_layer_fixed_s
        one = _dispatch(job, links)[None, :, None] + fixed
        ep_f = ep_f + one * work.moe_layers                        # every replica of a stage alike
        ep_b = ep_b + one * (work.moe_layers + work.moe_recomputed + work.moe_blocks_redone)
    cp_f = cp_b = np.zeros_like(tp_f)
    if layout.cp > 1:
        one_f, one_b = _context_parallel(job, work, links, rate, share)
        redone = work.layers if "core_attn" in layout.selective_modules else work.recomputed_layers
        cp_f, cp_b = one_f * work.layers, one_b * work.layers + one_f * redone
    if links.tp > 1:
        # The embedding's collectives (its vocab-parallel output reduced, or reduce-scattered under
        # SP and gathered back in the backward) and the output layer's (its input gathered under SP,
        # the loss's statistics), (dp, pp): on the first stage and the last.
        none = np.zeros_like(ar[:, :, 0])
        embedding_f, embedding_b = (ag[:, :, 0], ag[:, :, 0]) if sp else (ar[:, :, 0], none)
        output_f = (ag[:, :, 0] if sp else none) + _cross_entropy_comm(ring, tokens, workload.cross_entropy_fusion).T
        output_b = output_bwd[:, :, 0]
        tp_f[:, 0, 0] += embedding_f[:, 0]
        tp_b[:, 0, 0] += embedding_b[:, 0]
        tp_f[:, -1, -1] += output_f[:, -1]
        tp_b[:, -1, -1] += output_b[:, -1]
        if workload.mtp_layers:
            # Each MTP layer's embedding and output layer again, and its projection's: under SP its
            # 2h-wide input gathered, then (no SP too) its output gathered over TP
            # (gather_from_tensor_model_parallel_region); its backward collectives run behind its
            # GEMMs as the other column-parallel linears' do.
            projection_f = (3 if sp else 1) * ag[:, -1, 0]
            tp_f[:, -1, -1] += workload.mtp_layers * (embedding_f[:, -1] + output_f[:, -1] + projection_f)
            tp_b[:, -1, -1] += workload.mtp_layers * (embedding_b[:, -1] + output_b[:, -1])
    fwd, bwd, rc = work.forward.seconds(rate), work.backward.seconds(rate), work.recompute.seconds(rate)
    forward_s, backward_s = fwd + tp_f + cp_f + ep_f, bwd + rc + tp_b + cp_b + ep_b
    ep = ep_f + ep_b
    if work.moe_layer is not None:
        # Per micro-batch, what its steady-state pairs save (the forwards before the first backward,
        # and the last backwards, run alone), taken from its forward and backward in proportion.
        saved = work.moe_layers * _expert_overlap_saving(job, work, links, rate, share) * _paired_share(job)
        forward_share = np.divide(forward_s, forward_s + backward_s, out=np.zeros_like(forward_s),
                                  where=saved > 0)     # a chunk without MoE layers saves nothing
        forward_s, backward_s, ep = (forward_s - saved * forward_share, backward_s - saved * (1 - forward_share),
                                     ep - saved)
    fsdp_f, fsdp_b = fsdp.microbatch_exposed(job, links, work.layers, forward_s, backward_s, share)
    forward_s, backward_s = forward_s + fsdp_f, backward_s + fsdp_b
    offload_f, offload_b = _offload_exposed(job, links, forward_s, backward_s)
    forward_s, backward_s = forward_s + offload_f, backward_s + offload_b
    message = act / (layout.tp if sp else 1)
    hop, xchg = links.p2p_s(message), links.exchange_s(message)
    times = schedules.StageTimes(forward_s=forward_s, backward_s=backward_s,
                                 fwd_comm_s=hop.activation, bwd_comm_s=hop.gradient,
                                 fwd_xchg_s=None if xchg is None else xchg.activation,
                                 bwd_xchg_s=None if xchg is None else xchg.gradient)
    return _Stages(times=times, compute=fwd + bwd, recompute=rc, tp_comm=tp_f + tp_b, cp_comm=cp_f + cp_b,
                   ep_comm=ep, dp_comm=fsdp_f + fsdp_b)


def _offload_exposed(job: Job, links: GroupLinks, forward_s: np.ndarray,
                     backward_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds (dp, pp, v) the --cpu-offloading-num-layers copies of one
    micro-batch add to its chunk (PP 1: one chunk), its layers taken equal: each layer's stored
    bytes over the host link one way (cost.offload)."""
    n = job.layout.cpu_offloading_num_layers
    if not n:
        return np.zeros_like(forward_s), np.zeros_like(backward_s)
    if links.host_link_Bps is None:
        raise Infeasible(f"--cpu-offloading-num-layers {n}: the cluster gives no host-link bandwidth "
                         "(host_link_bandwidth_Bps of the presets) to price the copies with")
    layers = job.chunk_sizes[0][0]
    moe = job.moe_layers[0][0] if job.moe_layers else 0
    copy_s = chunk_stored_bytes(job, n, min(moe, n)) / n / links.host_link_Bps
    return offload.microbatch_exposed(layers, n, forward_s / layers, backward_s / layers, copy_s)


def _run_schedule(schedule: schedules.Schedule, times: schedules.StageTimes, m: int,
                  simulate: bool) -> schedules.PipelineTime:
    """Run the schedule once per distinct replica (all replicas alike on a uniform cluster)."""
    arrays = {f.name: getattr(times, f.name) for f in fields(times) if getattr(times, f.name) is not None}
    same = all(np.ptp(a, axis=0).max() == 0 for a in arrays.values())
    one = schedules.StageTimes(**{k: a[:1] for k, a in arrays.items()}) if same else times
    out = (schedule.simulate if simulate else schedule.time)(one, m)
    if not same:
        return out
    dp = times.forward_s.shape[0]
    return schedules.PipelineTime(**{k: np.repeat(getattr(out, k), dp, axis=0) for k in
                                     ("total_s", "finish_s", "busy_s", "p2p_s")}, exact=out.exact)


def edge_bucket_share(job: Job, params: StageParameters, buckets: int) -> float:
    """Share of stage 0's gradients in its last bucket to reduce (and its first to all-gather):
    an even share of its buckets, or the word embedding's, which a bucket cannot split and whose
    gradient is complete only when the backward ends (param_and_grad_buffer builds buckets in
    backward order, whole parameters each)."""
    return max(1 / buckets, word_embedding_per_rank(job.workload, job.layout.tp) / params.total[0])


def _dp_exposed(job: Job, links: GroupLinks, schedule: schedules.Schedule, stages: _Stages, crit: int,
                params: StageParameters, optimizer_s: np.ndarray, share: float) -> tuple[np.ndarray, float]:
    """(pp,) gradient reduction per stage still running after the stage's finish, and the
    exposed parameter all-gather of the distributed optimizer, with what the hidden part of both
    takes from the compute beside it (`share`, Execution.nccl_compute_share: the busiest rank's).

    With overlap_grad_reduce, and for the parameter all-gather with overlap_param_gather, the
    schedule says what shows (Schedule.grad_reduce_exposed, Schedule.param_gather_exposed); the
    max over stages hides a later stage's reduction behind the others' cooldown.
    Dense gradients reduce over data x context parallel, expert gradients over expert data
    parallel, one after the other on the data-parallel stream. `optimizer_s` (pp,): each stage's
    optimizer step."""
    workload, layout = job.workload, job.layout
    replicas, experts = layout.dp * layout.cp, links.experts
    if replicas == 1 and (experts is None or layout.expert_data_parallel_size == 1):
        return np.zeros(layout.pp), 0.0
    ring, dopt = links.dp_cp_groups, layout.use_distributed_optimizer

    def both(collective: str, per_param: int, layer_bytes: float | None = None) -> np.ndarray:
        """(pp,) the dense and the expert collective of each stage (worst TP rank's group);
        `layer_bytes`: what a parameter of the layers' linears moves where they are gathered
        quantised (Workload.param_gather_bytes)."""
        dense = params.dense * per_param - (params.dense_in_layers * (per_param - layer_bytes) if layer_bytes else 0)
        out = getattr(ring, collective)(dense[:, None]).max(axis=1)
        expert = params.expert * (layer_bytes or per_param)
        return out + (getattr(experts.edp_groups, collective)(expert) if experts else 0.0)

    reduce = both("reduce_scatter_s" if dopt else "all_reduce_s", workload.grad_bytes)
    if fsdp.shards_gradients(layout):       # reduce-scattered by every backward (in its stage times)
        reduce = np.zeros_like(reduce)
    buckets = max(1, math.ceil(params.total[0] / max(DDP_MIN_BUCKET_PARAMS, 1_000_000 * replicas)))
    edge = edge_bucket_share(job, params, buckets)
    backward = stages.times.backward_s[crit]                                    # (p, v)
    exposed = schedule.grad_reduce_exposed(reduce, backward, edge) if layout.overlap_grad_reduce else reduce
    contention = share * float((reduce - exposed).max())
    gather = 0.0
    if dopt and not fsdp.shards_parameters(layout):     # FSDP's: gathered by every pass (its stage times)
        ag = both("all_gather_s", workload.bytes_per_element, workload.param_gather_bytes)
        # The first of v equal chunks is updated first; its all-gather runs behind the other v-1.
        window = optimizer_s * (1 - 1 / job.virtual_stages) if layout.overlap_param_gather_with_optimizer_step \
            else np.zeros(layout.pp)
        gather = schedule.param_gather_exposed(ag, stages.times.forward_s[crit], stages.times.fwd_comm_s[crit],
                                               edge, window) if layout.overlap_param_gather else float(ag.max())
        contention += share * max(0.0, float(ag.max()) - gather)
    return exposed, gather + contention


@dataclass(frozen=True, kw_only=True)
class _Pipeline:
    """One forward-backward pass of every replica's pipeline (_pipeline)."""

    stages: _Stages
    schedule: schedules.Schedule
    """The schedule Megatron runs."""
    times: schedules.PipelineTime
    """Its pass, per replica."""
    critical: int
    """The replica that finishes last."""


def _pipeline(job: Job, work: StageWork, links: GroupLinks, execution: Execution, simulate: bool) -> _Pipeline:
    """The stage times, the schedule Megatron runs, its pass per replica and the critical replica."""
    layout = job.layout
    assert (links.tp, links.pp, links.dp, links.cp) == (layout.tp, layout.pp, layout.dp, layout.cp), \
        "links are for another grid"
    stages = _stage_times(job, work, links, execution)
    schedule = schedules.schedule_for(layout.pp, job.virtual_stages)
    pipe = _run_schedule(schedule, stages.times, job.num_microbatches, simulate)
    return _Pipeline(stages=stages, schedule=schedule, times=pipe, critical=int(np.argmax(pipe.total_s)))


def iteration_time(job: Job, cluster: Cluster, work: StageWork, links: GroupLinks, *,
                   simulate: bool = False, execution: Execution = DEFAULT_EXECUTION) -> TimeEstimate:
    """Predicted iteration time of `job` from its per-chunk `work` (cost.compute.stage_work) and
    its groups' `links` (cost.comm.group_links, for the placement wanted); `simulate` times the
    pipeline with the event-driven simulator instead of the closed forms."""
    return _estimate(job, cluster, links, _pipeline(job, work, links, execution, simulate), execution,
                     simulate=simulate, extrapolations=work.extrapolations)


def _estimate(job: Job, cluster: Cluster, links: GroupLinks, pipeline: _Pipeline, execution: Execution, *,
              simulate: bool, extrapolations: tuple[str, ...]) -> TimeEstimate:
    """The iteration around the pipeline's pass (_pipeline): data-parallel reduction and gather,
    the tied embedding's all-reduce, the optimizer step, and the breakdown."""
    workload, layout = job.workload, job.layout
    stages, schedule, pipe, crit = pipeline.stages, pipeline.schedule, pipeline.times, pipeline.critical
    m = job.num_microbatches
    t_pipe = float(pipe.total_s[crit])
    params = stage_parameters(job)
    shards = (layout.dp * layout.cp, layout.expert_data_parallel_size) if layout.use_distributed_optimizer else (1, 1)
    optimizer_s = (params.dense / shards[0] + params.expert / shards[1]) * optimizer_bytes_per_param(workload) \
        / cluster.memory_bandwidth_Bps
    exposed, gather = _dp_exposed(job, links, schedule, stages, crit, params, optimizer_s,
                                  execution.nccl_compute_share)
    done = pipe.finish_s.max(axis=0) + exposed                                   # (pp,) DP reduction ends
    t_dp = max(t_pipe, float(done.max()))
    t_sync = t_dp
    if job.embedding_on_last_stage:
        words = word_embedding_per_rank(workload, layout.tp) * workload.grad_bytes
        t_sync = max(t_dp, max(done[0], done[-1]) + float(links.embedding_groups.all_reduce_s(words).max()))
    optimizer = float(optimizer_s.max())
    total = t_sync + gather + optimizer
    busiest = int(np.argmax(pipe.busy_s[crit]))
    compute = m * float(stages.compute[crit, busiest].sum())
    recompute = m * float(stages.recompute[crit, busiest].sum())
    tp_comm = m * float(stages.tp_comm[crit, busiest].sum())
    cp_comm = m * float(stages.cp_comm[crit, busiest].sum())
    ep_comm = m * float(stages.ep_comm[crit, busiest].sum())
    fsdp_comm = m * float(stages.dp_comm[crit, busiest].sum())
    pp_comm = float(pipe.p2p_s[crit, busiest])
    breakdown = TimeBreakdown(
        compute_s=compute, recompute_s=recompute, tp_comm_s=tp_comm, cp_comm_s=cp_comm, ep_comm_s=ep_comm,
        pp_comm_s=pp_comm,
        pipeline_bubble_s=max(0.0, t_pipe - compute - recompute - tp_comm - cp_comm - ep_comm - pp_comm - fsdp_comm),
        dp_comm_exposed_s=t_dp - t_pipe + gather + fsdp_comm, embedding_allreduce_s=float(t_sync - t_dp),
        optimizer_s=optimizer)
    worst_f = stages.times.forward_s.sum(axis=2).max(axis=0)
    worst_b = stages.times.backward_s.sum(axis=2).max(axis=0)
    return TimeEstimate(
        iteration_time_s=total,
        tflops_per_gpu=workload.model_flops_per_iteration() / total / layout.world_size / 1e12,
        breakdown=breakdown,
        stage_times=tuple(StageTime(forward_s=float(f), backward_s=float(b)) for f, b in zip(worst_f, worst_b)),
        schedule=schedule.name, exact_schedule=pipe.exact or simulate, extrapolations=extrapolations)


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """One iteration's forward-backward pass on the critical replica, event by event (for pictures)."""

    estimate: TimeEstimate
    """The iteration's prediction, as iteration_time gives it."""
    events: tuple[simulator.Event, ...]
    """Every pipeline rank's passes and blocked p2p intervals (cost.simulator.Event)."""
    recompute_s: np.ndarray
    """(p, v) recomputed forward compute inside one backward of chunk c on pipeline rank r."""
    pipeline_s: float
    """End of the simulated forward-backward pass."""
    microbatches: int


def iteration_timeline(job: Job, cluster: Cluster, work: StageWork, links: GroupLinks, *,
                       execution: Execution = DEFAULT_EXECUTION) -> Timeline:
    """iteration_time's prediction with the event-driven simulator's trace of its critical replica."""
    pipeline = _pipeline(job, work, links, execution, simulate=False)
    trace = pipeline.schedule.trace(pipeline.stages.times, job.num_microbatches, pipeline.critical)
    estimate = _estimate(job, cluster, links, pipeline, execution, simulate=False,
                         extrapolations=work.extrapolations)
    return Timeline(estimate=estimate, events=trace.events,
                    recompute_s=pipeline.stages.recompute[pipeline.critical], pipeline_s=float(trace.total_s),
                    microbatches=job.num_microbatches)
