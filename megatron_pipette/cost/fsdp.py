"""Megatron-FSDP (--use-megatron-fsdp): what each device holds under a --data-parallel-sharding-strategy,
and what its per-layer parameter all-gathers and gradient reduce-scatters add to each micro-batch.

It follows megatron-core 0.19.2's core/distributed/fsdp/src/megatron_fsdp/. Each strategy shards over
the data x context-parallel group (experts' state over expert data parallel) a bit more than the one
before it:
- optim: the optimizer state only. Gradients reduce on the last micro-batch and the parameters are
  all-gathered after the step (MegatronFSDP.is_delay_grad_reduce), so it costs what the distributed
  optimizer costs, and it is priced as that.
- optim_grads: the gradients too. Every backward reduce-scatters its gradients
  (_process_post_backward_gradients: grad_reduce_every_bprop).
- optim_grads_params: the parameters too. Every transformer layer is an FSDP unit (mcore_fsdp_adapter:
  fsdp_unit_modules = [TransformerLayer, ...]). Its forward pre-hook all-gathers it and prefetches the
  next unit (AllGatherPipeline.all_gather_params: up to suggested_communication_unit_size / 2 elements
  more, which by default is one layer). Its post-forward hook releases it, and before the backward it
  is gathered again. Buckets outside the units (embedding, output layer, final norm) stay gathered
  (AllGatherPipeline.reset: preserve_non_fsdp_units).
"""

from __future__ import annotations

import numpy as np

from megatron_pipette.cost.comm import GroupLinks
from megatron_pipette.cost.parameters import StageParameters, stage_parameters, word_embedding_per_rank
from megatron_pipette.cost.schedules.without_interleaving import overlapped
from megatron_pipette.spec.job import Job
from megatron_pipette.spec.layout import Layout

UNITS_GATHERED = 2
"""Layers whose whole parameters (and gradients) a device holds at once: the one running and the
one prefetched for it. --fsdp-double-buffer's fixed pool has two units (FixedPoolAllocator size 2,
_enforce_double_buffer_limit), and without it the default prefetch reaches one unit ahead
(suggested_communication_unit_size defaults to two layers' elements, of which half is prefetched).
Gradients likewise: the layer the backward writes and the one being reduce-scattered
(GradReducePipeline's queue of one unit's elements)."""


def shards_gradients(layout: Layout) -> bool:
    """Gradients are reduce-scattered by every backward and held sharded."""
    return layout.use_megatron_fsdp and layout.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")


def shards_parameters(layout: Layout) -> bool:
    """Parameters are held sharded and each layer gathered when it runs, forward and backward."""
    return layout.use_megatron_fsdp and layout.data_parallel_sharding_strategy == "optim_grads_params"


def units(job: Job, stage: int) -> int:
    """The stage's FSDP units: its transformer layers (an MTP layer's is one too)."""
    return job.stage_layers[stage] + (job.workload.mtp_layers if stage == job.layout.pp - 1 else 0)


def embedding_gradient_parameters(job: Job) -> int:
    """Parameters (of stage 0, one device) whose gradient only the end of the backward makes: the
    learned position embedding and an untied word embedding, whose lookup is the forward's first
    op. A word embedding tied to the output layer, or read again by the MTP layers, has its first
    gradient at the start of the backward instead."""
    workload, tp = job.workload, job.layout.tp
    positions = workload.embedding_parameters(tp) - workload.padded_vocab_size(tp) * workload.hidden_size
    late = workload.untie_embeddings_and_output_weights and not workload.mtp_layers
    return positions + (word_embedding_per_rank(workload, tp) if late else 0)


def held_state(job: Job, stage: int, params: StageParameters, weight_bytes: int, gradient_bytes: int,
               weight: int, gradient: int) -> tuple[int, int]:
    """(weight, gradient) bytes one device of `stage` holds under FSDP at the activations' peak, from
    the unsharded ones (`weight` and `gradient` bytes per parameter outside the layers):
    - a sharded state is its 1/(DP x CP) shard (experts' 1/expert DP) of the buffer it is kept in:
      the model weight buffer holds each parameter once, in the training dtype or under
      --fp8-param-gather (--fp4-param-gather) its quantised rowwise bytes (param_and_grad_buffer.py
      _init_each_parameter_group_buffers: uint8 for an FP8 group, a transpose buffer only for MXFP8);
    - UNITS_GATHERED layers are whole in that form, and the one running its backward also has its
      derived copies (an FP8 weight's transpose: megatron_fsdp.py all_gather_module_parameters makes
      it only in the backward, fp8_create_transpose_cache, and release_module_parameters discards it,
      --keep-fp8-transpose-cache being off);
    - the weights outside the units stay gathered whole (AllGatherPipeline.reset:
      preserve_non_fsdp_units). Their gradients are whole only from their module's backward to its
      reduce-scatter (GradReducePipeline: free_up_grad_bucket frees each bucket once reduced): FSDP
      runs PP 1, one micro-batch in flight, so the input embedding's (embedding_gradient_parameters)
      comes after the last layer's backward has freed the activations, and only the output layer's
      and final norm's are held at the peak."""
    workload, layout = job.workload, job.layout
    dense, expert, in_layers = int(params.dense[stage]), int(params.expert[stage]), int(params.dense_in_layers[stage])
    layer_params, outside = in_layers + expert, dense - in_layers
    dense_shards, expert_shards = layout.dp * layout.cp, layout.expert_data_parallel_size
    n = max(units(job, stage), 1)
    sharded = (in_layers / dense_shards + expert / expert_shards) / layer_params if layer_params else 0.0

    def held(layers: int, stored: float, rest: int, rest_whole: int) -> int:
        """`layers` bytes of the units in all their copies, `stored` bytes of them in the buffer;
        `rest` bytes outside the units, `rest_whole` of them whole at the peak."""
        unit, stored_unit = layers / n, stored / n
        gathered = min(UNITS_GATHERED, n) * stored_unit + (unit - stored_unit)
        return int(np.ceil(stored * sharded + rest / dense_shards + gathered + rest_whole))

    weights = weight_bytes
    if shards_parameters(layout):
        rest = weight * outside
        layers = weight_bytes - rest
        stored = workload.param_gather_bytes * layer_params if workload.keeps_quantised_weights else layers
        weights = held(layers, stored, rest, rest)
    gradients = gradient_bytes
    if shards_gradients(layout):
        rest = gradient * outside
        late = embedding_gradient_parameters(job) if stage == 0 else 0
        gradients = held(gradient_bytes - rest, gradient_bytes - rest, rest, gradient * (outside - late))
    return weights, gradients


def microbatch_exposed(job: Job, links: GroupLinks, layers: np.ndarray,
                       forward_s: np.ndarray, backward_s: np.ndarray, share: float) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds (dp, pp, v) that one micro-batch's FSDP collectives add to each
    chunk. Layer by layer, each collective runs behind the layer before it on the data-parallel
    stream (prefetched one unit ahead). The forward has the parameter all-gathers (optim_grads_params).
    The backward has them again, and the gradient reduce-scatters (optim_grads, optim_grads_params),
    both on the same links. A chunk's first gather (and its last reduce-scatter) waits: the exposed
    part is `overlapped` with one layer's share left in the open, the bucket-by-bucket rule of the
    distributed optimizer's reduction. What hides takes `share` (Execution.nccl_compute_share) of the
    compute beside it. `layers` (pp, v): transformer layers per chunk. `forward_s`, `backward_s`: the
    chunks' times without FSDP."""
    workload, layout = job.workload, job.layout
    zero = np.zeros_like(forward_s)
    if not shards_gradients(layout):
        return zero, zero
    params = stage_parameters(job)      # past the guard: every estimate without FSDP passes through here
    n = np.maximum(np.array([units(job, r) for r in range(layout.pp)]), 1)
    dense, expert = params.dense_in_layers / n, params.expert / n           # (pp,) per layer on one device

    def per_layer(collective: str, per_param: float) -> np.ndarray:
        """(pp,) one layer's collective on the worst TP rank's group, and its experts' on expert DP."""
        out = getattr(links.dp_cp_groups, collective)((dense * per_param)[:, None]).max(axis=1)
        if links.experts is not None and expert.any():
            out = out + getattr(links.experts.edp_groups, collective)(expert * per_param)
        return out

    gather = per_layer("all_gather_s", workload.param_gather_bytes or workload.bytes_per_element) \
        if shards_parameters(layout) else np.zeros(layout.pp)
    reduce = per_layer("reduce_scatter_s", workload.grad_bytes)
    chunk = layers[None, :, :]                                              # (1, pp, v)
    last = np.divide(1.0, chunk, out=np.ones_like(chunk, dtype=float), where=chunk > 0)

    def added(per_layer_s: np.ndarray, window: np.ndarray) -> np.ndarray:
        total = per_layer_s[None, :, None] * chunk
        exposed = overlapped(total, window, last)
        return exposed + share * (total - exposed)

    return added(gather, forward_s), added(gather + reduce, backward_s)
