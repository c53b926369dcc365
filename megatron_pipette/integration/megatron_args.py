"""Translate between Megatron's parsed `args` and the planner's Workload and Layout.

Torch-free: it reads and writes attributes of an argparse namespace. Which
layout flags the user typed (constraints for the search) is read from the
command line itself, since Megatron's defaults are indistinguishable from
typed values once parsed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_pipette.errors import PipetteError, UnrunnableFlags
from megatron_pipette.integration.plan_check import JobRequest
from megatron_pipette.plan.planner import MEMORY_HEADROOM
from megatron_pipette.spec.layout import VIRTUAL_STAGES, Layout, virtual_stages_as_layers
from megatron_pipette.spec.megatron_flags import check_priced
from megatron_pipette.spec.resume import ResumeRule, resume_rule
from megatron_pipette.spec.workload import Workload, attention_backend_built, megatron_flag

LAYOUT_FLAGS = {megatron_flag(name): name for name in (*(f.name for f in dataclasses.fields(Layout)
                                                         if f.name != "data_parallel_size"), VIRTUAL_STAGES)}
# Megatron has one flag per direction of a switch; both pin the field.
NEGATED_FLAGS = {"--no-overlap-grad-reduce": "overlap_grad_reduce",
                 "--no-overlap-param-gather": "overlap_param_gather"}


def typed_flags(argv: Sequence[str]) -> set[str]:
    """Layout field names whose Megatron flag appears on the command line."""
    typed = set()
    for token in argv:
        name = token.split("=", 1)[0]
        if name in LAYOUT_FLAGS:
            typed.add(LAYOUT_FLAGS[name])
        elif name in NEGATED_FLAGS:
            typed.add(NEGATED_FLAGS[name])
    return typed


def _enum_name(value: Any) -> str:
    return getattr(value, "name", str(value))


def workload_from_args(args: Any) -> Workload:
    """The planner's Workload for the model Megatron was asked to train. Raises PipetteError naming
    every argument set to something the planner cannot price (spec/megatron_flags.py): planning
    such a job would be silently wrong."""
    check_priced(vars(args))
    if args.global_batch_size is None:
        raise PipetteError("--auto-parallel needs an explicit --global-batch-size "
                           "(the planner chooses the data-parallel size, which Megatron's default depends on)")
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if args.vocab_size is None and getattr(args, "padded_vocab_size", None) is None:
        raise PipetteError("--auto-parallel needs the vocabulary size: pass --vocab-size "
                           "(the tokenizer is built only after the layout is chosen)")
    return Workload(
        name="the model of these Megatron flags",
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length, global_batch_size=args.global_batch_size,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
        group_query_attention=bool(args.group_query_attention),
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        swiglu=bool(args.swiglu), quick_geglu=bool(getattr(args, "quick_geglu", False)),
        activation_func_clamp_value=getattr(args, "activation_func_clamp_value", None),
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
        vocab_size=args.vocab_size or args.padded_vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        untie_embeddings_and_output_weights=bool(args.untie_embeddings_and_output_weights),
        position_embedding_type=args.position_embedding_type, max_position_embeddings=args.max_position_embeddings,
        rotary_scaling_factor=getattr(args, "rotary_scaling_factor", 1.0), mscale=getattr(args, "mscale", 1.0),
        mscale_all_dim=getattr(args, "mscale_all_dim", 0.0),
        normalization=args.normalization, add_bias_linear=bool(args.add_bias_linear),
        bias_gelu_fusion=bool(getattr(args, "bias_gelu_fusion", True)),
        bias_swiglu_fusion=bool(getattr(args, "bias_swiglu_fusion", True)),
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        attention_backend=_attention_backend(args), precision=precision,
        grad_reduce_in_bf16=bool(getattr(args, "grad_reduce_in_bf16", False)),
        cross_entropy_loss_fusion=bool(getattr(args, "cross_entropy_loss_fusion", False)),
        cross_entropy_fusion_impl=getattr(args, "cross_entropy_fusion_impl", "native"),
        cuda_graph_impl=getattr(args, "cuda_graph_impl", "none"),
        cuda_graph_modules=tuple(_enum_name(m) for m in getattr(args, "cuda_graph_modules", None) or ()),
        **_attention_fields(args), **_moe_fields(args), **_fp8_fields(args), **_optimizer_fields(args))


def _attention_backend(args: Any) -> str:
    """--attention-backend as Megatron builds it (spec.workload.attention_backend_built)."""
    requested = _enum_name(getattr(args, "attention_backend", "auto"))
    return attention_backend_built(requested, transformer_engine_in_use(args))


def _attention_fields(args: Any) -> dict[str, Any]:
    """--qk-layernorm, the sliding window, the softmax and multi-latent attention's widths when it is
    on; Megatron parses --window-size into a tuple and a list --window-attn-skip-freq into a list
    (the Workload takes their text)."""
    window, skip = getattr(args, "window_size", None), getattr(args, "window_attn_skip_freq", None)
    fields: dict[str, Any] = {"qk_layernorm": bool(getattr(args, "qk_layernorm", False)),
                              "window_size": None if window is None else ",".join(map(str, window)),
                              "window_attn_skip_freq": str(skip) if isinstance(skip, list) else skip,
                              "softmax_type": getattr(args, "softmax_type", "vanilla")}
    if getattr(args, "multi_latent_attention", False):
        fields.update(multi_latent_attention=True, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
                      qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
                      v_head_dim=args.v_head_dim)
    return fields


def _fp8_fields(args: Any) -> dict[str, Any]:
    """--fp8-format or --fp4-format and their recipes; FP8 and FP4 GEMMs are Transformer Engine's, so
    without it Megatron would fail (or train without them) and the plan would be priced for the wrong
    kernels."""
    fp8, fp4 = getattr(args, "fp8", None), getattr(args, "fp4", None)
    if fp8 is None and fp4 is None:
        return {}
    if not transformer_engine_in_use(args):
        flag = f"--fp8-format {fp8}" if fp8 is not None else f"--fp4-format {fp4}"
        raise PipetteError(f"{flag} needs Transformer Engine (installed, and "
                           f"--transformer-impl transformer_engine)")
    fields = {} if fp8 is None else {
        "fp8": fp8, "fp8_recipe": args.fp8_recipe, "fp8_param_gather": bool(getattr(args, "fp8_param_gather", False)),
        "reuse_grad_buf_for_mxfp8_param_ag": bool(getattr(args, "reuse_grad_buf_for_mxfp8_param_ag", False))}
    if fp4 is not None:
        fields.update(fp4=fp4, fp4_recipe=args.fp4_recipe,
                      fp4_param_gather=bool(getattr(args, "fp4_param_gather", False)))
    return fields


def _optimizer_fields(args: Any) -> dict[str, Any]:
    """--use-precision-aware-optimizer and its dtypes, by name: validate_args maps them to torch
    dtypes (fp8 to uint8), which the hook may see before or after."""
    names = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "uint8": "fp8"}
    fields = {"use_precision_aware_optimizer": bool(getattr(args, "use_precision_aware_optimizer", False))}
    for name in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        value = getattr(args, name, "fp32")
        fields[name] = value if isinstance(value, str) else names.get(str(value).removeprefix("torch."), str(value))
    return fields


def _moe_fields(args: Any) -> dict[str, Any]:
    """The mixture-of-experts fields; Megatron turns --num-experts 0 into None and parses a list
    --moe-layer-freq into a list (the Workload takes its text)."""
    experts = getattr(args, "num_experts", None) or None
    if experts is None:
        return {}
    freq = args.moe_layer_freq
    return {"num_experts": experts, "moe_router_topk": args.moe_router_topk,
            "moe_ffn_hidden_size": args.moe_ffn_hidden_size,
            "moe_shared_expert_intermediate_size": args.moe_shared_expert_intermediate_size,
            "moe_layer_freq": str(freq) if isinstance(freq, list) else freq,
            "moe_expert_capacity_factor": args.moe_expert_capacity_factor,
            "moe_pad_expert_input_to_capacity": bool(args.moe_pad_expert_input_to_capacity),
            "moe_token_dispatcher_type": args.moe_token_dispatcher_type,
            **{name: getattr(args, name) for name in ("moe_flex_dispatcher_backend", "moe_enable_deepep",
                                                      "moe_router_num_groups",
                                                      "moe_router_group_topk", "moe_router_dtype",
                                                      "moe_expert_rank_capacity_factor", "moe_paged_stash",
                                                      "moe_paged_stash_buffer_size_factor_cuda",
                                                      "moe_paged_stash_buffer_size_factor_cpu",
                                                      "use_transformer_engine_op_fuser")
               if hasattr(args, name)}}


def layout_from_args(args: Any, world_size: int) -> Layout:
    """The layout the user's own flags describe (the fallback when planning fails)."""
    values = {}
    for f in dataclasses.fields(Layout):
        if f.name != "data_parallel_size":
            value = getattr(args, f.name, f.default)
            values[f.name] = bool(value) if isinstance(f.default, bool) else value
    if getattr(args, VIRTUAL_STAGES, None) is not None:
        values = virtual_stages_as_layers(args.num_layers, {**values, VIRTUAL_STAGES: getattr(args, VIRTUAL_STAGES)})
    if isinstance(values["cp_comm_type"], list):   # Megatron's is one entry per layer, or one for all
        values["cp_comm_type"] = values["cp_comm_type"][0]
    values["recompute_modules"] = _modules(values["recompute_modules"], values["recompute_granularity"])
    tp, pp, cp = (values[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                      "context_parallel_size"))
    return Layout(**values, data_parallel_size=max(1, world_size // (tp * pp * cp)))


def _modules(value: Any, granularity: str | None) -> Any:
    """Megatron's --recompute-modules list (the Layout holds it as a tuple); None where it has no
    effect (without selective recomputation)."""
    return value if granularity == "selective" else None


def constraints_from_args(args: Any, argv: Sequence[str]) -> dict[str, Any]:
    """The layout fields the user fixed by typing their flag beside --auto-parallel, plus what
    this installation cannot run: sequence parallelism needs Transformer Engine's or apex's
    norms (megatron-core's torch LayerNorm asserts against it), context parallelism Transformer
    Engine's attention; typed where they cannot run, they stop the job (UnrunnableFlags)."""
    constraints = virtual_stages_as_layers(args.num_layers, {name: getattr(args, name) for name in typed_flags(argv)})
    if constraints.get("overlap_param_gather_with_optimizer_step"):
        raise PipetteError("--overlap-param-gather-with-optimizer-step: Megatron does not support it with "
                           "distributed checkpointing, which --auto-parallel saves in so that a restart can "
                           "resume in another layout; leave the flag out")
    if isinstance(constraints.get("cp_comm_type"), list):
        constraints["cp_comm_type"] = constraints["cp_comm_type"][0]
    if "recompute_modules" in constraints:
        constraints["recompute_modules"] = tuple(constraints["recompute_modules"])
    if not sequence_parallel_supported(args):
        if constraints.setdefault("sequence_parallel", False):
            raise UnrunnableFlags("--sequence-parallel needs Transformer Engine's or apex's norms (megatron-core's "
                                  "torch LayerNorm asserts against it): install one, or leave the flag out")
        typed_tp = constraints.get("tensor_model_parallel_size", 1)
        if getattr(args, "num_experts", None) and typed_tp > 1:
            raise UnrunnableFlags(f"--tensor-model-parallel-size {typed_tp} with --num-experts needs "
                                  "--sequence-parallel (Megatron's MoE layer raises without it), which needs "
                                  "Transformer Engine's or apex's norms: install one, or leave the TP size to the "
                                  "planner")
    if not transformer_engine_in_use(args):   # only Transformer Engine's attention splits the sequence
        typed_cp = constraints.setdefault("context_parallel_size", 1)
        if typed_cp > 1:
            raise UnrunnableFlags(f"--context-parallel-size {typed_cp} needs Transformer Engine's attention "
                                  f"(installed, and --transformer-impl transformer_engine)")
    return constraints


def job_request(args: Any, argv: Sequence[str], world_size: int, gpus_per_node: int,
                checkpoint: ResumeRule | None) -> JobRequest:
    """What this job asks of a plan (plan_check): the model, the size, the flags typed, and what the
    checkpoint to resume from fixes (`checkpoint`: checkpoint_rule)."""
    typed = constraints_from_args(args, argv)
    return JobRequest(workload=workload_from_args(args), world_size=world_size, gpus_per_node=gpus_per_node,
                      typed=typed, checkpoint=checkpoint,
                      eval_global_batch_size=getattr(args, "eval_global_batch_size", None),
                      eval_micro_batch_size=getattr(args, "eval_micro_batch_size", None),
                      memory_headroom=getattr(args, "auto_parallel_memory_headroom", 100 * MEMORY_HEADROOM) / 100)


def checkpoint_rule(saved_args: Any, content_metadata: Mapping[str, Any] | None, args: Any,
                    release: bool = False) -> ResumeRule:
    """What the checkpoint whose own Megatron arguments are `saved_args` (and content metadata
    `content_metadata`, both from its common state) fixes of this job's layout (spec.resume.resume_rule
    lists what and why): the optimizer state binds only where Megatron loads it (not a release
    checkpoint, not --finetune, not --no-load-optim, not saved with --no-save-optim:
    training/checkpointing.py:2205-2213), and a distributed optimizer's sharding type is the one saved,
    or for checkpoints without one what Megatron assumes (training/checkpointing.py:2217-2228)."""
    saved = layout_from_args(saved_args, saved_args.world_size)
    if saved.expert_tensor_parallel_size == saved.tp:     # validate_args resolved Megatron's default
        saved = dataclasses.replace(saved, expert_tensor_parallel_size=None)
    loads = not (release or getattr(args, "finetune", False) or getattr(args, "no_load_optim", False)
                 or getattr(saved_args, "no_save_optim", False))
    sharding = (content_metadata or {}).get("distrib_optim_sharding_type")
    if sharding is None and saved.use_distributed_optimizer:
        sharding = ("fully_sharded_model_space" if getattr(saved_args, "ckpt_fully_parallel_save", False)
                    else "dp_zero_gather_scatter")
    return resume_rule(saved, moe=bool(getattr(saved_args, "num_experts", None)), loads_optimizer=loads,
                       optimizer_sharding=sharding)


def overridden_by_checkpoint(request: JobRequest) -> str | None:
    """What the checkpoint overrides of the flags typed, said in one line; None when nothing."""
    kept = request.checkpoint.equalities if request.checkpoint is not None else {}
    overridden = [name for name, value in kept.items() if name in request.typed and request.typed[name] != value]
    if not overridden:
        return None
    return (", ".join(f"{megatron_flag(name)} {request.typed[name]}" for name in overridden)
            + " ignored: the checkpoint in --load was saved with "
            + ", ".join(f"{megatron_flag(name)} {kept[name]}" for name in overridden)
            + ", which Megatron cannot convert; resuming with it")


def transformer_engine_in_use(args: Any) -> bool:
    return (getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine"
            and importlib.util.find_spec("transformer_engine") is not None)


def sequence_parallel_supported(args: Any) -> bool:
    return transformer_engine_in_use(args) or importlib.util.find_spec("apex") is not None


def apply_layout(args: Any, layout: Layout) -> None:
    """Rewrite Megatron's layout arguments, before validate_args derives the rest from them."""
    for field in dataclasses.fields(Layout):
        if field.name != "data_parallel_size":
            setattr(args, field.name, getattr(layout, field.name))
    args.num_virtual_stages_per_pipeline_rank = None   # the layout gives VP in layers a chunk; Megatron takes one
    args.cp_comm_type = [layout.cp_comm_type]   # Megatron's form: a list
    args.recompute_modules = None if layout.recompute_modules is None else list(layout.recompute_modules)
    # recompute_num_layers has a Megatron default of 1 only meaningful with full recompute.
    if layout.recompute_granularity != "full":
        args.recompute_method = None


def make_resumable_across_layouts(args: Any) -> None:
    """Checkpoints that another layout can load: distributed checkpoints, and optimizer
    state saved fully reshardable (the default dp_reshardable cannot change TP or PP)."""
    args.ckpt_format = "torch_dist"
    if hasattr(args, "dist_ckpt_optim_fully_reshardable"):
        args.dist_ckpt_optim_fully_reshardable = True
