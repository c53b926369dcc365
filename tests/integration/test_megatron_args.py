"""Translation between Megatron's parsed args and the planner's descriptions (no torch)."""

from types import SimpleNamespace

import pytest

from helpers.megatron_args import megatron_namespace
from megatron_pipette.errors import PipetteError, UnrunnableFlags
from megatron_pipette.integration import megatron_args as ma
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset


def test_typed_flags_are_the_constraints():
    argv = ["--num-layers", "4", "--tensor-model-parallel-size=2", "--sequence-parallel", "--no-overlap-grad-reduce",
            "--auto-parallel"]
    assert ma.typed_flags(argv) == {"tensor_model_parallel_size", "sequence_parallel", "overlap_grad_reduce"}


def test_sequence_parallel_is_ruled_out_without_te_or_apex(monkeypatch):
    monkeypatch.setattr(ma, "sequence_parallel_supported", lambda args: False)
    monkeypatch.setattr(ma, "transformer_engine_in_use", lambda args: True)
    args = megatron_namespace(tensor_model_parallel_size=2)
    assert ma.constraints_from_args(args, ["--tensor-model-parallel-size", "2"]) == {
        "tensor_model_parallel_size": 2, "sequence_parallel": False}


def test_typed_sequence_parallelism_without_te_or_apex_stops_the_job(monkeypatch):
    """Megatron's torch LayerNorm asserts against SP: falling back to the typed flag would fail
    too, so the hook stops with the flag's name (UnrunnableFlags); typed off, it is a constraint."""
    monkeypatch.setattr(ma, "sequence_parallel_supported", lambda args: False)
    monkeypatch.setattr(ma, "transformer_engine_in_use", lambda args: True)
    args = megatron_namespace(tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(UnrunnableFlags, match="^--sequence-parallel needs Transformer Engine's or apex's norms"):
        ma.constraints_from_args(args, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    monkeypatch.setattr(ma, "sequence_parallel_supported", lambda args: True)
    assert ma.constraints_from_args(args, ["--sequence-parallel"]) == {"sequence_parallel": True}


def test_typed_tensor_parallelism_under_moe_without_te_or_apex_stops_the_job(monkeypatch):
    """Megatron's MoE layer needs SP beside TP, and SP needs TE's or apex's norms: a typed TP 2 with
    --num-experts cannot run here (the planner, left the TP size, keeps TP 1)."""
    monkeypatch.setattr(ma, "sequence_parallel_supported", lambda args: False)
    monkeypatch.setattr(ma, "transformer_engine_in_use", lambda args: True)
    args = megatron_namespace(tensor_model_parallel_size=2, num_experts=4)
    with pytest.raises(UnrunnableFlags, match="^--tensor-model-parallel-size 2 with --num-experts needs "
                                              "--sequence-parallel"):
        ma.constraints_from_args(args, ["--tensor-model-parallel-size", "2", "--num-experts", "4"])
    assert ma.constraints_from_args(args, ["--num-experts", "4"]) == {"sequence_parallel": False}


def test_a_flag_the_line_cannot_run_stops_every_rank_strict_or_not():
    """The ranks' statuses: a planning failure falls back (the reason names each rank); an
    UnrunnableFlags failure on any rank stops them all, as the user's own line would fail too, and so
    does a missing rank (hung or dead), which is then the reason given."""
    from megatron_pipette.integration.decide import failure_verdict

    assert failure_verdict(["ok:a", "failed:probe timed out", "failed:probe timed out"]) == \
        ("rank 1,2: probe timed out", False)
    assert failure_verdict(["stop:--sequence-parallel needs x", "stop:--sequence-parallel needs x"]) == \
        ("rank 0,1: --sequence-parallel needs x", True)
    assert failure_verdict(["ok:a", "ok:b"]) == ("ranks hold different plans", False)
    assert failure_verdict(["failed:budget exceeded", "missing:no answer", "ok:a"]) == ("rank 1: no answer", True)


def test_context_parallelism_is_ruled_out_without_te(monkeypatch):
    """Only Transformer Engine's attention splits the sequence: without it CP stays 1, and a typed
    CP > 1 is refused by name."""
    monkeypatch.setattr(ma, "transformer_engine_in_use", lambda args: False)
    args = megatron_namespace()
    assert ma.constraints_from_args(args, [])["context_parallel_size"] == 1
    args = megatron_namespace(context_parallel_size=2)
    with pytest.raises(UnrunnableFlags, match="^--context-parallel-size 2 needs Transformer Engine's attention"):
        ma.constraints_from_args(args, ["--context-parallel-size", "2"])
    monkeypatch.setattr(ma, "transformer_engine_in_use", lambda args: True)
    assert ma.constraints_from_args(args, ["--context-parallel-size", "2"])["context_parallel_size"] == 2


def test_param_gather_with_optimizer_step_is_refused_beside_the_checkpoints_auto_parallel_needs():
    """Megatron asserts --overlap-param-gather-with-optimizer-step off under distributed
    checkpointing, which the hook sets so a restart can change layout: a clear error, not
    Megatron's assertion on every rank."""
    args = megatron_namespace(overlap_param_gather_with_optimizer_step=True)
    with pytest.raises(PipetteError, match="^--overlap-param-gather-with-optimizer-step: Megatron does not "
                                           "support it with distributed checkpointing"):
        ma.constraints_from_args(args, ["--overlap-param-gather-with-optimizer-step"])


def test_workload_refuses_what_the_planner_cannot_price():
    with pytest.raises(PipetteError, match=r"^--moe-shared-expert-gate: this mixture-of-experts option is not "
                                           r"modelled$"):
        ma.workload_from_args(megatron_namespace(num_experts=64, moe_shared_expert_gate=True))
    with pytest.raises(PipetteError) as every:
        ma.workload_from_args(megatron_namespace(hybrid_context_parallel=True, use_checkpoint_args=True))
    assert sorted(str(every.value).split("; ")) == [
        "--hybrid-context-parallel: hierarchical or hybrid context parallelism is not modelled",
        "--use-checkpoint-args: the checkpoint's arguments would replace the planned ones"]
    assert ma.workload_from_args(megatron_namespace(num_experts=None, context_parallel_size=1)).num_layers == 4


def test_fp8_needs_transformer_engine(monkeypatch):
    """FP8 GEMMs are Transformer Engine's: without it the hook names the flag instead of planning."""
    monkeypatch.setattr(ma, "transformer_engine_in_use", lambda args: False)
    with pytest.raises(PipetteError, match=r"^--fp8-format hybrid needs Transformer Engine"):
        ma.workload_from_args(megatron_namespace(fp8="hybrid", fp8_recipe="delayed"))
    monkeypatch.setattr(ma, "transformer_engine_in_use", lambda args: True)
    w = ma.workload_from_args(megatron_namespace(fp8="hybrid", fp8_recipe="tensorwise"))
    assert (w.fp8, w.fp8_recipe) == ("hybrid", "tensorwise")
    w = ma.workload_from_args(megatron_namespace(fp8="e4m3", fp8_recipe="mxfp8", fp8_param_gather=True,
                                                 reuse_grad_buf_for_mxfp8_param_ag=True))
    assert (w.fp8_recipe, w.fp8_param_gather, w.reuse_grad_buf_for_mxfp8_param_ag) == ("mxfp8", True, True)
    w = ma.workload_from_args(megatron_namespace(bf16=True, fp4="e2m1", fp4_recipe="nvfp4", fp4_param_gather=True))
    assert (w.fp4, w.fp4_recipe, w.fp4_param_gather, w.fp8) == ("e2m1", "nvfp4", True, None)
    monkeypatch.setattr(ma, "transformer_engine_in_use", lambda args: False)
    with pytest.raises(PipetteError, match=r"^--fp4-format e2m1 needs Transformer Engine"):
        ma.workload_from_args(megatron_namespace(bf16=True, fp4="e2m1", fp4_recipe="nvfp4"))


def test_moe_arguments_become_the_workload():
    """Megatron's parsed MoE arguments (a list --moe-layer-freq among them) reach the workload."""
    w = ma.workload_from_args(megatron_namespace(num_experts=8, moe_router_topk=2, moe_layer_freq=[1, 0, 1, 0],
                                                 moe_ffn_hidden_size=96, swiglu=True, add_bias_linear=False))
    assert (w.num_experts, w.moe_router_topk, w.moe_ffn) == (8, 2, 96)
    assert w.moe_layer_pattern() == (True, False, True, False)


@pytest.mark.parametrize("flags, with_te, local", [
    ({}, False, False),                                                    # GELU experts, biases, fused
    ({"swiglu": True}, False, False),                                      # SwiGLU experts with biases, fused
    ({"swiglu": True, "add_bias_linear": False}, True, True),
    ({"add_bias_linear": False}, True, True),                     # Megatron then turns the GELU fusion off
    ({"bias_gelu_fusion": False}, True, False),                   # unfused biases: local layers only fail
    ({"swiglu": True, "bias_swiglu_fusion": False}, True, False),
    ({"swiglu": True, "bias_gelu_fusion": False}, False, False),  # the GELU switch does not reach SwiGLU
])
def test_expert_activations_megatron_cannot_run_stop_the_hook_before_planning(flags, with_te, local, monkeypatch):
    """`--num-experts 4 --moe-router-topk 2` without `--swiglu --disable-bias-linear` planned in full and
    failed in Megatron's first forward; the hook now stops on it (its fallback, the same flags, would
    fail too), naming the flags. Without Transformer Engine (the local layers) expert biases never run."""
    args = megatron_namespace(num_experts=4, moe_router_topk=2, **flags)
    for te, runs in ((True, with_te), (False, local)):
        monkeypatch.setattr(ma, "transformer_engine_in_use", lambda args, te=te: te)
        if runs:
            assert ma.workload_from_args(args).num_experts == 4
        else:
            with pytest.raises(UnrunnableFlags, match=r"^--num-experts 4 (--swiglu )?with .*--disable-bias-linear"):
                ma.workload_from_args(args)


@pytest.mark.parametrize("field, value", [("position_embedding_type", "mrope"), ("normalization", "GroupNorm"),
                                          ("attention_backend", "sparse")])
def test_workload_refuses_values_it_does_not_know(field, value):
    with pytest.raises(PipetteError, match=f"^--{field.replace('_', '-')} {value}: only "):
        ma.workload_from_args(megatron_namespace(**{field: value}))


def test_workload_needs_global_batch_and_vocab():
    assert ma.workload_from_args(megatron_namespace()).precision == "bf16"
    with pytest.raises(PipetteError, match="--global-batch-size"):
        ma.workload_from_args(megatron_namespace(global_batch_size=None))
    with pytest.raises(PipetteError, match="--vocab-size"):
        ma.workload_from_args(megatron_namespace(vocab_size=None))


def test_apply_layout_rewrites_megatrons_args():
    args = megatron_namespace()
    layout = Layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=1,
                    micro_batch_size=4, num_layers_per_virtual_pipeline_stage=1, use_distributed_optimizer=True)
    ma.apply_layout(args, layout)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.micro_batch_size) == (2, 2, 4)
    assert args.num_layers_per_virtual_pipeline_stage == 1
    assert args.use_distributed_optimizer and ma.layout_from_args(args, 4) == layout


def test_the_fallback_layout_has_megatrons_data_parallel_size():
    layout = ma.layout_from_args(megatron_namespace(context_parallel_size=2, cp_comm_type=["a2a"]), 8)
    assert (layout.dp, layout.cp, layout.cp_comm_type) == (4, 2, "a2a")


def test_checkpoints_are_saved_reshardable():
    """Distributed checkpoints with fully reshardable optimizer state, so that another layout can load them."""
    args = megatron_namespace()
    ma.make_resumable_across_layouts(args)
    assert args.ckpt_format == "torch_dist" and args.dist_ckpt_optim_fully_reshardable


@pytest.mark.parametrize("layers, pp, lpv, embedding, loss",
                         [(126, 8, None, True, True), (127, 8, None, False, True), (127, 8, None, True, False),
                          (31, 4, None, True, False), (30, 2, None, True, True), (15, 8, None, True, False),
                          (126, 8, 4, True, True), (126, 8, 2, True, True), (127, 4, 8, False, True),
                          (31, 4, 2, True, False), (32, 4, 2, False, False), (24, 4, 3, False, False)])
def test_pipeline_split_is_megatrons(layers, pp, lpv, embedding, loss):
    """Layers per (stage, chunk) and each chunk's first layer against megatron-core's own
    get_num_layers_to_build and get_transformer_layer_offset, chunk by chunk."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_pipette.spec.job import resolve_job

    layout = Layout(pipeline_model_parallel_size=pp, num_layers_per_virtual_pipeline_stage=lpv,
                    account_for_embedding_in_pipeline_split=embedding, account_for_loss_in_pipeline_split=loss)
    job = resolve_job(workload_from_preset("tiny-gpt", num_layers=layers, global_batch_size=8 * pp), layout)
    vp = job.virtual_stages if lpv else None
    config = SimpleNamespace(pipeline_model_parallel_layout=None, num_layers_in_first_pipeline_stage=None,
                             num_layers_in_last_pipeline_stage=None, num_layers=layers,
                             pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                             account_for_embedding_in_pipeline_split=embedding,
                             account_for_loss_in_pipeline_split=loss)
    chunks = job.chunk_layers()
    for r in range(pp):
        for c in range(job.virtual_stages):
            stage = c if vp else None
            assert job.chunk_sizes[r][c] == get_num_layers_to_build(config, vp_stage=stage, pp_rank=r)
            if chunks[r][c]:
                assert chunks[r][c][0] == get_transformer_layer_offset(config, vp_stage=stage, pp_rank=r)


def test_recompute_modules_travel_as_megatron_lists():
    """Megatron parses --recompute-modules into a list (nargs *); the layout holds a tuple, and only
    under selective recomputation, where Megatron reads it."""
    args = megatron_namespace(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    assert ma.layout_from_args(args, 2).recompute_modules == ("core_attn", "mlp")
    assert ma.layout_from_args(megatron_namespace(recompute_modules=["mlp"]), 2).recompute_modules is None
    typed = ma.constraints_from_args(args, ["--recompute-modules", "core_attn", "mlp"])
    assert typed["recompute_modules"] == ("core_attn", "mlp")
    ma.apply_layout(args, Layout(recompute_granularity="selective", recompute_modules=("mlp",)))
    assert args.recompute_modules == ["mlp"]
    ma.apply_layout(args, Layout())
    assert args.recompute_modules is None


@pytest.mark.parametrize("text, pp, layers", [
    ("Et*3|t*4|t*4|t*4L", 4, 15), ("Et|(t*2|)*6,tL", 4, 14), ("E|t*8|t*8|L", 4, 16),
    ("Ett|tt|tt|tt|tt|tt|tt|ttL", 4, 16), ("E(t|)*7tL", 2, 8), ("Et*8L", 1, 8)])
def test_pipeline_layout_string_is_megatrons(text, pp, layers):
    """--pipeline-model-parallel-layout: layers per (stage, chunk) equal megatron-core's own parse
    (PipelineParallelLayerLayout: virtual stage i is rank i % PP's chunk i // PP), and Megatron's
    validation accepts exactly what ours does."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from megatron_pipette.spec.layout import chunk_sizes

    theirs = PipelineParallelLayerLayout(text, pp)
    theirs.validate_layer_layout(layers, None)
    ours = chunk_sizes(workload_from_preset("tiny-gpt", num_layers=layers),
                       Layout(pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=text))
    assert ours == [[chunk.count(LayerType.decoder) for chunk in stage] for stage in theirs.layout]


@pytest.mark.parametrize("text, pp, layers, why", [
    ("tEt*3|t*4L", 2, 8, "must start with the embedding"), ("Et*3|t*4", 2, 7, "end with the loss"),
    ("Et*3|t*4L", 2, 8, "places 7 transformer layers"), ("Et*3|t*4|tL", 2, 8, "not a multiple"),
    ("Et*3|t*3mL", 2, 6, "multi-token")])
def test_pipeline_layout_strings_megatron_rejects_are_infeasible(text, pp, layers, why):
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from megatron_pipette.errors import Infeasible
    from megatron_pipette.spec.layout import chunk_sizes

    with pytest.raises(AssertionError):
        PipelineParallelLayerLayout(text, pp).validate_layer_layout(layers, None)
    with pytest.raises(Infeasible, match=why):
        chunk_sizes(workload_from_preset("tiny-gpt", num_layers=layers),
                    Layout(pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=text))


def test_without_transformer_engine_the_attention_keeps_its_scores(monkeypatch):
    """Megatron's local layer spec builds DotProductAttention, which stores the s x s scores,
    whatever --attention-backend says; with Transformer Engine's spec the flag decides."""
    monkeypatch.setattr(ma, "transformer_engine_in_use", lambda args: False)
    assert ma.workload_from_args(megatron_namespace(attention_backend="auto")).attention_backend == "local"
    monkeypatch.setattr(ma, "transformer_engine_in_use", lambda args: True)
    assert ma.workload_from_args(megatron_namespace(attention_backend="flash")).attention_backend == "flash"


def test_the_cache_key_identity_names_the_gpus_given(monkeypatch):
    """Without a visible GPU UUID (here: no GPU), the GPUs a job was given are CUDA_VISIBLE_DEVICES'."""
    from megatron_pipette.integration.decide import _identity

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    two = _identity()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert two["gpu"] == "2,3" and _identity()["gpu"] == "0,1" and two["host"] == _identity()["host"]


def test_virtual_stages_per_rank_are_read_typed_and_cleared_as_megatron_takes_them():
    """--num-virtual-stages-per-pipeline-rank: priced (not refused), typed as the layers a chunk it builds,
    read back from a job's (or checkpoint's) arguments, and cleared where the plan writes VP its own way
    (Megatron refuses the two together)."""
    args = megatron_namespace(num_layers=8, pipeline_model_parallel_size=4, num_virtual_stages_per_pipeline_rank=2)
    argv = ["--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank", "2", "--auto-parallel"]
    ma.workload_from_args(args)
    typed = ma.constraints_from_args(args, argv)
    assert (typed["num_layers_per_virtual_pipeline_stage"], typed["pipeline_model_parallel_size"]) == (1, 4)
    assert "num_virtual_stages_per_pipeline_rank" not in typed
    assert ma.layout_from_args(args, 4).num_layers_per_virtual_pipeline_stage == 1
    ma.apply_layout(args, ma.layout_from_args(args, 4))
    assert (args.num_virtual_stages_per_pipeline_rank, args.num_layers_per_virtual_pipeline_stage) == (None, 1)
    with pytest.raises(PipetteError, match="--num-virtual-stages-per-pipeline-rank 3 must divide"):
        ma.constraints_from_args(megatron_namespace(num_layers=8, pipeline_model_parallel_size=4,
                                                    num_virtual_stages_per_pipeline_rank=3), argv)


def test_cuda_graph_arguments_become_the_workload():
    """--cuda-graph-modules as Megatron's parser leaves it (CudaGraphModule members, or the deprecated
    word full_iteration before validate_args migrates it) reaches the workload by name."""
    from enum import Enum

    Module = Enum("CudaGraphModule", "attn mlp")
    w = ma.workload_from_args(megatron_namespace(cuda_graph_impl="transformer_engine",
                                                 cuda_graph_modules=[Module.attn, Module.mlp]))
    assert (w.cuda_graph_impl, w.cuda_graph_modules) == ("transformer_engine", ("attn", "mlp"))
    w = ma.workload_from_args(megatron_namespace(cuda_graph_impl="none", cuda_graph_modules=["full_iteration"]))
    assert (w.cuda_graph_impl, w.cuda_graph_modules) == ("full_iteration", ())
