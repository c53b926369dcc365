"""--recompute-modules: what selective recomputation of each module drops from the stored activations,
rematerialises in the backward, and redoes (work and collectives), counted by hand against
Korthikanti et al.'s terms and Megatron's checkpointed modules (TransformerLayer, MLP, MoELayer)."""

import dataclasses

import pytest

from megatron_pipette.cost import experts
from megatron_pipette.cost.execution import Execution
from megatron_pipette.cost.memory import activation_bytes_per_layer, estimate_memory
from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import Infeasible, PipetteError
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout, validate_layout
from megatron_pipette.spec.workload import Workload, workload_from_preset
from megatron_pipette.units import GiB

GPT = workload_from_preset("gpt3-1.3b", global_batch_size=64)
MOE = Workload(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=4096, global_batch_size=64,
               ffn_hidden_size=4096, swiglu=True, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=2048,
               moe_layer_freq="([0]+[1]*7)", add_bias_linear=False, normalization="RMSNorm",
               position_embedding_type="rope", vocab_size=32000, untie_embeddings_and_output_weights=True,
               moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=2048,
               precision="bf16")
H100x8 = preset_cluster("dgx-h100", num_nodes=1)


def job(workload=GPT, modules=None, granularity="selective", **layout):
    return resolve_job(workload, Layout(**{"data_parallel_size": 1, "recompute_granularity": granularity,
                                           "recompute_modules": modules, **layout}))


def test_the_default_modules_are_the_attention_core():
    """Megatron's TransformerConfig: selective without --recompute-modules redoes core_attn."""
    model = CostModel(H100x8)
    implicit, explicit = job(tensor_model_parallel_size=8), job(modules=("core_attn",), tensor_model_parallel_size=8)
    assert model.memory(implicit) == model.memory(explicit)
    assert model.time(implicit) == model.time(explicit)


def test_a_checkpointed_mlp_keeps_only_its_input():
    """mlp: fc1's output (2 x 4h x e, SwiGLU 2x) and fc2's input (4h x e) are dropped per token and TP
    rank; the checkpoint keeps the MLP's input in the training dtype, which is fc1's input (bf16: the
    same bytes)."""
    tokens, t = GPT.seq_length, 2
    base = activation_bytes_per_layer(job(modules=("core_attn",), tensor_model_parallel_size=t))
    both = activation_bytes_per_layer(job(modules=("core_attn", "mlp"), tensor_model_parallel_size=t))
    assert base - both == tokens * (2 * GPT.ffn + 2 * GPT.ffn) // t


def test_moe_modules_drop_their_tensors():
    """moe: the MoE block keeps its input only; moe_act: the experts' activation output (fc2's input);
    shared_experts: the shared experts' fc1 output and activation."""
    j = job(MOE, modules=("core_attn",), expert_model_parallel_size=8, data_parallel_size=8)
    full = experts.moe_activation_bytes(j)
    rows, fc2 = experts.routed_rows(j), MOE.moe_ffn_hidden_size
    assert experts.moe_activation_bytes(j, frozenset({"moe"})) == 0
    assert full - experts.moe_activation_bytes(j, frozenset({"moe_act"})) == round(rows * 2 * fc2)
    shared = 2 * MOE.seq_length * 2048 * 3
    assert full - experts.moe_activation_bytes(j, frozenset({"shared_experts"})) == shared


def test_what_is_dropped_is_rematerialised_one_layer_at_a_time():
    """Every stored layer of every in-flight micro-batch drops the MLP's tensors; the backward pays one
    layer's back while it runs (a transient): the peak falls by at least (in flight x layers - 1)
    times the dropped bytes."""
    kw = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=2)
    a, b = (estimate_memory(job(modules=m, **kw), 80 * GiB).stages[0] for m in (("core_attn",), ("core_attn", "mlp")))
    dropped = activation_bytes_per_layer(job(modules=("core_attn",), **kw)) - activation_bytes_per_layer(
        job(modules=("core_attn", "mlp"), **kw))
    stored = 2 * GPT.num_layers // 2          # two micro-batches in flight on stage 0, 12 layers each
    assert a.activation_bytes - b.activation_bytes == stored * dropped
    assert b.transient_bytes >= dropped
    saved = (a.activation_bytes + a.transient_bytes) - (b.activation_bytes + b.transient_bytes)
    assert (stored - 1) * dropped <= saved <= stored * dropped


def test_mlp_recomputation_redoes_the_mlp_and_its_collectives():
    """Additive work: redoing core_attn and mlp costs what each costs alone; the MLP's forward TP
    collective (an all-reduce without SP) runs again in every layer's backward."""
    model = CostModel(H100x8)
    kw = dict(tensor_model_parallel_size=8)
    none, core, mlp, both = (model.time(job(modules=m, **kw)).breakdown for m in
                             ((), ("core_attn",), ("mlp",), ("core_attn", "mlp")))
    assert none.recompute_s == 0
    assert both.recompute_s == pytest.approx(core.recompute_s + mlp.recompute_s, rel=1e-12)
    assert 0 < core.recompute_s < none.compute_s / 2 and 0 < mlp.recompute_s < none.compute_s / 2
    j = job(modules=("mlp",), **kw)
    act = GPT.seq_length * GPT.hidden_size * GPT.bytes_per_element
    ar = float(model.links(j).tp_groups.all_reduce_s(act).max())
    assert mlp.tp_comm_s - none.tp_comm_s == pytest.approx(j.num_microbatches * GPT.num_layers * ar, rel=1e-9)


def test_layernorm_on_a_dense_model_is_taken_to_change_nothing():
    """Transformer Engine fuses a dense layer's norms into QKV and fc1 (its layer spec has no
    separate norm module), where Megatron's layernorm recomputation has nothing to redo: priced as
    nothing, which is also the upper bound on memory for the local implementation."""
    model = CostModel(H100x8)
    plain, norm = job(modules=("core_attn",), tensor_model_parallel_size=8), job(
        modules=("core_attn", "layernorm"), tensor_model_parallel_size=8)
    assert model.memory(plain) == model.memory(norm)
    assert model.time(plain).iteration_time_s == model.time(norm).iteration_time_s


def test_moe_recomputation_dispatches_again():
    """moe redoes the whole MoE block, its all-to-all dispatch and combine included: the forward's
    once more in the backward, so the expert-parallel communication grows by half (without the
    dispatcher's host wait, which only the forwards have)."""
    model = CostModel(H100x8, execution=Execution())
    kw = dict(expert_model_parallel_size=8, data_parallel_size=8)
    core, moe = (model.time(job(MOE, modules=m, **kw)).breakdown for m in (("core_attn",), ("core_attn", "moe")))
    assert moe.ep_comm_s == pytest.approx(1.5 * core.ep_comm_s, rel=1e-12)
    assert moe.recompute_s > core.recompute_s
    assert model.memory(job(MOE, modules=("core_attn", "moe"), **kw)).stages[0].activation_bytes < \
        model.memory(job(MOE, modules=("core_attn",), **kw)).stages[0].activation_bytes


def test_rules():
    with pytest.raises(Infeasible, match="--recompute-modules applies only with --recompute-granularity selective"):
        validate_layout(GPT, Layout(recompute_modules=("mlp",)))
    with pytest.raises(Infeasible, match="--recompute-modules mla_up_proj needs --multi-latent-attention"):
        validate_layout(GPT, Layout(recompute_granularity="selective", recompute_modules=("core_attn", "mla_up_proj")))
    with pytest.raises(PipetteError, match="--recompute-modules gdn_norm_out"):
        validate_layout(GPT, Layout(recompute_granularity="selective", recompute_modules=("gdn_norm_out",)))
    flags = job(modules=("core_attn", "mlp")).layout.megatron_args()
    assert "--recompute-modules core_attn mlp" in flags and "--recompute-granularity selective" in flags
    assert dataclasses.replace(job().layout, recompute_modules=("mlp",)).describe().endswith("rc=sel/mlp")
    assert Layout(recompute_modules=["mlp"]).recompute_modules == ("mlp",)    # a plan document's list, hashable
