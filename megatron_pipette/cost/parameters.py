"""Parameters one device holds, per pipeline stage, in the two kinds Megatron treats apart.

Dense parameters (attention, norms, dense MLPs, routers, shared experts, embeddings) are
replicated over the data- and context-parallel ranks, and their gradients are reduced (and the
distributed optimizer shards them) there; expert parameters over the expert data-parallel ranks
(world / (ETP x EP x PP)). Memory (weights, gradients, optimizer state) and time (gradient
reduction, parameter all-gather, optimizer step) both follow from these counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_pipette.spec.job import Job
from megatron_pipette.spec.workload import Workload


@dataclass(frozen=True, eq=False)
class StageParameters:
    dense: np.ndarray
    """(pp,) dense parameters on one device of each stage."""
    expert: np.ndarray
    """(pp,) expert parameters on one device of each stage (zeros for a dense model)."""
    dense_in_layers: np.ndarray
    """(pp,) of the dense ones, those of the transformer layers (not the embeddings or output layer)."""

    @property
    def total(self) -> np.ndarray:
        return self.dense + self.expert


def dense_layer_parameters(workload: Workload, tp: int, moe: bool = False) -> int:
    """One layer's dense parameters on one TP rank: linear weights and column-parallel biases are
    split over TP; norms, the row-parallel biases (attention projection, fc2), MLA's down
    projections and an MoE layer's router are replicated. An MoE layer's dense MLP part is its
    shared experts (which have no biases)."""
    h, bias = workload.hidden_size, workload.add_bias_linear
    replicated = 2 * workload.norm_parameters() + workload.attention_replicated_parameters()
    sharded = workload.attention_parameters() - workload.attention_replicated_parameters()
    if moe:
        replicated += workload.router_parameters()
        sharded += workload.shared_expert_parameters()
    else:
        replicated += h if bias else 0
        sharded += workload.mlp_parameters(workload.ffn) - (h if bias else 0)
    assert sharded % tp == 0, "validate_layout checks heads, groups and ffn divide by TP"
    return sharded // tp + replicated


def expert_layer_parameters(workload: Workload, ep: int, etp: int) -> int:
    """One MoE layer's routed experts on one device: E / EP experts, each split over ETP (biases
    only with ETP 1, which validate_layout enforces)."""
    return workload.num_experts // ep * workload.mlp_parameters(workload.moe_ffn) // etp


def word_embedding_per_rank(workload: Workload, tp: int) -> int:
    """The word embedding's parameters on one TP rank (vocab-parallel, the vocabulary padded by TP)."""
    return workload.padded_vocab_size(tp) * workload.hidden_size // tp


def stage_parameters(job: Job) -> StageParameters:
    """Per stage: its layers, plus the word (vocab-parallel) and learned position (replicated)
    embeddings on stage 0, and the final norm and output layer on the last stage (a second copy
    of a tied embedding when PP > 1). MTP layers sit on the last stage, each a layer of the last
    decoder layer's kind with its norms and projection (the projection column-parallel); with
    PP > 1 that stage also builds an embedding for them, beside its output layer, tied or not
    (GPTModel: "there will be both embedding layer and output layer in the mtp process stage")."""
    workload, layout = job.workload, job.layout
    tp, pp, h = layout.tp, layout.pp, workload.hidden_size
    mtp = workload.mtp_layers
    layers = np.array(job.stage_layers, dtype=np.int64)
    moe = np.array([sum(chunks) for chunks in job.moe_layers], dtype=np.int64) if job.moe_layers \
        else np.zeros(pp, dtype=np.int64)
    layers[-1] += mtp
    moe[-1] += mtp if workload.mtp_layer_is_moe else 0
    dense = (layers - moe) * dense_layer_parameters(workload, tp)
    expert = np.zeros(pp, dtype=np.int64)
    if moe.any():
        dense += moe * dense_layer_parameters(workload, tp, moe=True)
        expert = moe * expert_layer_parameters(workload, layout.ep, layout.etp)
    projection = 2 * h * h // tp
    dense[-1] += mtp * projection
    in_layers = dense.copy()
    words = word_embedding_per_rank(workload, tp)
    positions = workload.embedding_parameters(tp) - workload.padded_vocab_size(tp) * h
    dense[0] += words + positions
    dense[-1] += workload.norm_parameters() + mtp * workload.mtp_norm_parameters()
    if workload.untie_embeddings_and_output_weights or pp > 1:
        dense[-1] += words
    if mtp and pp > 1:
        dense[-1] += words + positions
    return StageParameters(dense=dense, expert=expert, dense_in_layers=in_layers)
