"""Mixture-of-experts layers: routed rows, expert GEMMs, dispatch volumes and saved activations.

Megatron's MoE layer (megatron/core/transformer/moe/): the router picks top-k experts per token;
the token dispatcher moves each token's k copies to the ranks holding those experts (alltoall:
an all-to-all over the expert-parallel group, then with ETP > 1 an all-gather over the expert
tensor-parallel group; allgather: an all-gather of every token over ETP x EP); the local experts
run their FFN on the rows they received, and the reverse path brings the results back, weighted
by the routing probabilities. Shared experts are a dense MLP over every token, TP-sharded like
the dense layers' MLP.

Per rank, with T tokens entering the layer (b s / CP, and / TP under sequence parallelism, which
Megatron requires for MoE with TP > 1):
  rows         R = T k ETP c; c = the capacity factor with --moe-pad-expert-input-to-capacity,
                   else min(1, capacity factor), dropless 1. Routing is taken as balanced: a real
                   router is not, and its busiest expert sets the pace (the load-balancing loss
                   keeps it near); docs/time-model.md says so.
  local experts L = E / EP, each R / L rows: a grouped GEMM, each expert's GEMM priced at its own
                   shape (its own weights read, its own main_grad accumulated: the roofline
                   floor binds at few rows per expert).
  budget       B = T k F rounded up to 256 rows, with --moe-expert-rank-capacity-factor F (HybridEP's
                   static receive buffer): the experts' buffers, what they keep for the backward and
                   their gradients are B rows; their GEMMs and casts run on the R rows received.
  paged stash  with --moe-paged-stash the kept rows are copied into one device buffer of |f| x (B / F,
                   or R where f < 0) rows per layer in flight (f: --moe-paged-stash-buffer-size-factor-
                   cuda), and back for the backward: R rows copied each way, device to device (host
                   only where that buffer is full, which balanced routing never fills). The copies run
                   on the stash's own stream (paged_stash.py stash_paged_tensors, reload_paged_tensors),
                   overlapped with the combine, the next layer's attention, router and dispatch, and
                   are waited for only before the next experts: no time is priced for them.
"""

from __future__ import annotations

import math

from megatron_pipette.cost.gemm import (
    GemmCurve,
    PartWork,
    Work,
    fp8_cast_bytes,
    linear_work,
    main_grad_bytes,
)
from megatron_pipette.spec.job import Job
from megatron_pipette.spec.workload import Workload, quantised_bytes

ROUTER_BYTES_PER_SCORE = 12
"""Router softmax/top-k per token and expert: fp32 logits written, read and the scores written."""


def tokens_in(job: Job) -> float:
    """T: tokens one rank feeds its MoE layers per micro-batch."""
    layout = job.layout
    return job.tokens_per_microbatch / (layout.tp if layout.sequence_parallel else 1)


def capacity_share(job: Job) -> float:
    """c: routed rows relative to balanced dropless routing."""
    w = job.workload
    factor = w.moe_expert_capacity_factor
    if factor is None:
        return 1.0
    return factor if w.moe_pad_expert_input_to_capacity else min(1.0, factor)


def routed_rows(job: Job) -> float:
    """R: rows the rank's local experts compute per micro-batch."""
    return tokens_in(job) * job.workload.moe_router_topk * job.layout.etp * capacity_share(job)


BUDGET_ALIGNMENT = 256
"""Rows HybridEP's budget is rounded up to under --use-transformer-engine-op-fuser, which the
capacity factor needs (moe_utils.py get_align_size_for_quantization: the CUTLASS grouped GEMM's)."""


def budget_rows(job: Job) -> int | None:
    """B: HybridEP's static budget of rows an expert rank receives per micro-batch, which sizes the
    dispatch's output and so every buffer of the experts (token_dispatcher.py _HybridEPManager.
    setup_metadata, megatron-core 0.19.2: int(T k factor) rounded up); None without
    --moe-expert-rank-capacity-factor (buffers sized to the rows received)."""
    factor = job.workload.moe_expert_rank_capacity_factor
    if factor is None:
        return None
    budget = int(tokens_in(job) * job.workload.moe_router_topk * factor)
    return budget + -budget % BUDGET_ALIGNMENT


def buffer_rows(job: Job) -> float:
    """Rows of the experts' input, output, saved tensors and their gradients: the budget's, else R."""
    budget = budget_rows(job)
    return routed_rows(job) if budget is None else budget


def stash_rows(job: Job) -> float:
    """Rows of the paged stash's device buffer per MoE layer and micro-batch in flight (paged_stash.py
    allocate_stash_buffers: |factor| x the peak over the step of the rows in flight, each layer
    counted at the budget / the capacity factor, experts.py avg_num_tokens, or at the rows received
    where the factor is negative). --moe-paged-stash runs with a capacity factor only."""
    w = job.workload
    factor = w.moe_paged_stash_buffer_size_factor_cuda
    per_layer = budget_rows(job) // w.moe_expert_rank_capacity_factor if factor >= 0 else routed_rows(job)
    return abs(factor) * per_layer


def _expert_widths(job: Job) -> tuple[int, int]:
    """(fc1 output, fc2 input) of one routed expert on one expert-TP rank."""
    w, etp = job.workload, job.layout.etp
    return w.moe_ffn * w.fc1_widening // etp, w.moe_ffn // etp


def moe_mlp(job: Job, memory_bandwidth_Bps: float, gemm: GemmCurve, linear: GemmCurve | None = None) -> PartWork:
    """The MLP half of an MoE layer on one rank: router, routed experts (grouped GEMMs over the
    local experts), the shared experts' dense MLP, and the memory-bound permutations and activation.
    `linear`: the experts' curve where it is not `gemm` (FP8; the router stays in 16 bits). Its
    `recompute` is what selective recomputation redoes (--recompute-modules moe: all of the
    forward; moe_act: the experts' activation; shared_experts: the shared experts' MLP)."""
    w, layout = job.workload, job.layout
    t, rows, h, e = tokens_in(job), routed_rows(job), w.hidden_size, w.bytes_per_element
    local = w.num_experts // layout.ep
    fc1, fc2 = _expert_widths(job)
    per_expert = rows / local
    linear = linear or gemm
    grads = main_grad_bytes(w)
    # Each local expert's GEMM at its own shape (a grouped GEMM runs one per expert, each reading its
    # own weights and accumulating its own main_grad), not one GEMM of all the rows.
    grouped = [linear_work(linear, per_expert, out, inp, grads, count=local) for out, inp in ((fc1, h), (h, fc2))]
    dense = [linear_work(gemm, t, w.num_experts, h, grads)]                      # the router, replicated
    shared = w.moe_shared_expert_intermediate_size
    n = job.tokens_per_microbatch
    fp8_gemms = [(rows, fc1, h), (rows, h, fc2)]
    shared_work, shared_act = [], 0
    if shared is not None:
        width = shared // layout.tp
        fp8_gemms += [(n, width * w.fc1_widening, h), (n, h, width)]
        shared_work = [linear_work(linear, rows_, out, inp, grads) for rows_, out, inp in fp8_gemms[2:]]
        shared_act = (w.fc1_widening + 1) * e * n * width
    cast_f, cast_b = fp8_cast_bytes(w.quantisation_recipe, fp8_gemms)
    moved = t * w.moe_router_topk * capacity_share(job) * h * e
    expert_act = (w.fc1_widening + 1) * e * rows * fc2   # the experts' activation: fc1's output in, its own out
    # The clamp's passes (clamp_half_bytes): forward 8 halves; backward each half's mask applied to its
    # gradient (gradient and input read, one written) and the two concatenated for fc1: 10.
    clamp = clamp_half_bytes(job)
    clamp_f, clamp_b = 8 * clamp, 10 * clamp
    mem = (4 * moved + t * h * e                        # permute and unpermute (gather, scatter-add), probs
           + (2 * rows * h * e if layout.etp > 1 else 0)    # regrouping rows after the ETP all-gather
           + expert_act + shared_act + ROUTER_BYTES_PER_SCORE * t * w.num_experts
           + expert_bias_bytes(job)) / memory_bandwidth_Bps
    parts = grouped + dense + shared_work
    forward = Work(flops=sum(f for f, _, _ in parts), mem_s=mem + (clamp_f + cast_f) / memory_bandwidth_Bps)
    redone = job.layout.selective_modules
    if "moe" in redone:
        recompute = forward
    else:
        recompute = Work(mem_s=(expert_act + clamp_f) / memory_bandwidth_Bps) if "moe_act" in redone else Work()
        if "shared_experts" in redone:
            recompute = recompute + Work(flops=sum(f for f, _, _ in shared_work),
                                         mem_s=shared_act / memory_bandwidth_Bps)
    return PartWork(forward=forward, recompute=recompute,
                    backward=Work(flops=sum(d + g for _, d, g in parts),
                                  mem_s=2 * mem + (clamp_b + cast_b) / memory_bandwidth_Bps),
                    wgrad=Work(flops=sum(g for _, _, g in grouped)))


def clamp_half_bytes(job: Job) -> float:
    """Bytes of one half of the routed experts' fc1 output where megatron-core clamps it in passes of
    its own (0 elsewhere): --activation-func-clamp-value with the fused quick-GeGLU
    (fusions/fused_bias_geglu.py, weighted_bias_quick_geglu_impl, megatron-core 0.19) clamps the gate
    and the linear half (each read and written) and concatenates them (read and written) before its
    kernel: 8 halves moved forward, and again where moe_act recomputes it; the concatenation is what
    the kernel keeps. The fused SwiGLU ignores the clamp; an unfused activation is priced as fused,
    its clamp included."""
    w = job.workload
    if w.activation_func_clamp_value is None or not (w.quick_geglu and w.bias_activation_fusion):
        return 0.0
    return w.bytes_per_element * routed_rows(job) * _expert_widths(job)[1]


def probability_bytes(workload: Workload) -> int:
    """Bytes of a routing probability: --moe-router-dtype's, else the training dtype's."""
    return {None: workload.bytes_per_element, "fp32": 4, "fp64": 8}[workload.moe_router_dtype]


def expert_bias_bytes(job: Job) -> float:
    """Bytes the routed experts' fc2 bias moves (TEGroupedMLP._apply_bias, megatron-core 0.19): fc2
    runs without it, then each expert's rows add bias x probability (read, written in the
    probabilities' dtype where wider), are concatenated (read, written) and cast back."""
    w = job.workload
    if not w.add_bias_linear:
        return 0.0
    e = w.bytes_per_element
    out = max(e, probability_bytes(w))
    return routed_rows(job) * w.hidden_size * (e + 3 * out + (out + e if out != e else 0))


def dispatch_bytes(job: Job) -> dict[str, float]:
    """Bytes each dispatcher collective moves per MoE layer and direction, as the collective's size:
    "a2a" what one rank sends to the expert-parallel group (its routed copies, itself included),
    "etp" the all-gather (and reduce-scatter back) of the rows over expert TP, "etp-ep" the
    allgather dispatcher's all-gather of every token over ETP x EP (and reduce-scatter back)."""
    w, layout = job.workload, job.layout
    t, h, e = tokens_in(job), w.hidden_size, w.bytes_per_element
    if w.moe_token_dispatcher_type == "alltoall":
        return {"a2a": t * w.moe_router_topk * capacity_share(job) * h * e,
                "etp": routed_rows(job) * h * e if layout.etp > 1 else 0.0, "etp-ep": 0.0, "flex": 0.0}
    if w.moe_token_dispatcher_type == "flex":     # every expert-TP rank of a chosen expert gets the token
        return {"a2a": 0.0, "etp": 0.0, "etp-ep": 0.0, "flex": routed_rows(job) * h * e}
    return {"a2a": 0.0, "etp": 0.0, "etp-ep": t * layout.etp * layout.ep * h * e, "flex": 0.0}


def flex_shares(job: Job, gpus_per_domain: int) -> tuple[float, float]:
    """(far, near) shares of the flex dispatcher (DeepEP, HybridEP) against an all-to-all of the
    same copies over its ETP x EP group (cost.comm.AllToAll.all_to_all_s). It sends each token once
    to every remote node holding one of its experts and fans it out there over NVLink: beyond the
    node E[distinct nodes a token's experts are on] / copies; inside it, every copy, N times an
    all-to-all's share, with N the NVLink domains (nodes) the group spans. Routing balanced, each token's top-k
    experts (of E, N nodes of E / N) drawn alike; with group-limited routing (G groups, M chosen,
    groups whole on nodes) the M groups drawn alike instead."""
    w, layout = job.workload, job.layout
    span = max(1, layout.ep * layout.etp // gpus_per_domain)
    if span == 1:
        return 1.0, 1.0
    if w.moe_router_num_groups is not None and w.moe_router_num_groups % span == 0:
        pool, per_node, picks = w.moe_router_num_groups, w.moe_router_num_groups // span, w.moe_router_group_topk
    else:
        pool, per_node, picks = w.num_experts, w.num_experts // span, w.moe_router_topk
    nodes_hit = span * (1 - math.comb(pool - per_node, picks) / math.comb(pool, picks))
    return nodes_hit / (w.moe_router_topk * layout.etp), float(span)


def moe_activation_bytes(job: Job, redone: frozenset[str] = frozenset()) -> int:
    """What the MLP half of an MoE layer keeps for its backward, one micro-batch, one rank (its input,
    the pre-MLP norm's output, is counted with the layer): router scores, the rows entering the
    experts, their fc1 output, fc2 input and routing probability (megatron-core 0.19 applies it
    inside the weighted SwiGLU, which keeps it; unpermute, called without the probabilities, keeps
    no expert output), and the shared experts' two wide tensors; the experts' rows are the budget's
    under HybridEP's (buffer_rows), the stash's with --moe-paged-stash (stash_rows). `redone`:
    --recompute-modules that drop some of it
    (moe: all of it, the block keeps its input only; moe_act: the experts' activation output, which
    is fc2's input; shared_experts: the shared experts' tensors)."""
    if "moe" in redone:
        return 0
    w, layout = job.workload, job.layout
    t, e = tokens_in(job), w.bytes_per_element
    shared = w.moe_shared_expert_intermediate_size
    shared_bytes = 0 if shared is None or "shared_experts" in redone else e * job.tokens_per_microbatch * (
        shared // layout.tp) * (w.fc1_widening + 1)
    clamped = 0 if "moe_act" in redone else 2 * clamp_half_bytes(job)   # the clamped copy the kernel keeps
    rows = stash_rows(job) if w.moe_paged_stash else buffer_rows(job)
    return round(8 * t * w.num_experts + rows * expert_row_bytes(job, redone) + clamped + shared_bytes)


def expert_row_bytes(job: Job, redone: frozenset[str]) -> float:
    """Bytes the routed experts keep per row for their backward: fc1's input (its FP8 cast under
    --fp8-format), fc1's output, fc2's input unless moe_act is recomputed, and the routing
    probability. Transformer Engine's fused grouped MLP marks exactly these for the paged stash
    (TE 2.20 ops/fused/grouped_mlp.py: mark_grouped_tensor(saved_fc1_x, activation_in, scales,
    grouped_fc2_x))."""
    w = job.workload
    fc1, fc2 = _expert_widths(job)
    lin = fp8_input_bytes(w)
    fc2_in = 0 if "moe_act" in redone else lin * fc2
    return lin * w.hidden_size + w.bytes_per_element * fc1 + fc2_in + probability_bytes(w)


def fp8_input_bytes(workload: Workload) -> float:
    """Bytes per element a linear keeps of its input for the weight gradient: Transformer Engine
    keeps the FP8 cast under --fp8-format (one copy: under MXFP8 the columnwise one with its
    scales, module/linear.py update_usage(rowwise_usage=False, columnwise_usage=True)), else the
    training dtype's."""
    recipe = workload.quantisation_recipe
    return workload.bytes_per_element if recipe is None else quantised_bytes(recipe)


def moe_backward_bytes(job: Job) -> int:
    """Gradients of the experts' two wide tensors in flight during an MoE layer's backward (budget rows
    where there is one); with the clamp's passes (clamp_half_bytes) also the clamped halves' gradients
    beside their concatenation, and the clamped copy where moe_act recomputed it; with the paged stash
    the layer's saved tensors reloaded from it into buffers of the budget's rows."""
    fc1, fc2 = _expert_widths(job)
    clamp = (4 if "moe_act" in job.layout.selective_modules else 2) * clamp_half_bytes(job)
    reloaded = buffer_rows(job) * expert_row_bytes(job, job.layout.selective_modules) \
        if job.workload.moe_paged_stash else 0
    return round(job.workload.bytes_per_element * buffer_rows(job) * (fc1 + fc2) + clamp + reloaded)
