"""The table of Megatron's arguments and the check on a parsed namespace (no torch)."""

import argparse
import enum

import pytest

from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.megatron_flags import ALLOWED_VALUES, check_priced, flag_table, refusals


def megatron_defaults(**values) -> argparse.Namespace:
    """A namespace like Megatron's parsed args: every refused argument at Megatron's default,
    the value-checked ones at Megatron's defaults, then `values`."""
    defaults = {name: refused.default for name, refused in flag_table().refused.items()}
    defaults.update(position_embedding_type="learned_absolute", normalization="LayerNorm",
                    attention_backend="auto", transformer_impl="transformer_engine", optimizer="adam",
                    rerun_mode="validate_results", num_layers=24, lr=1e-4, seed=1234)
    return argparse.Namespace(**{**defaults, **values})


def refused(**values) -> list[str]:
    return [str(r) for r in refusals(vars(megatron_defaults(**values)))]


def test_megatron_defaults_are_never_refused():
    assert refused() == []


@pytest.mark.parametrize("values, message", [
    ({"moe_shared_expert_gate": True}, "--moe-shared-expert-gate: this mixture-of-experts option is not modelled"),
    ({"hierarchical_context_parallel_sizes": [2, 2]}, "--hierarchical-context-parallel-sizes 2 2: hierarchical"),
    ({"overlap_dispatch_backward_with_experts_wgrad": True}, "--overlap-dispatch-backward-with-experts-wgrad: this"),
    ({"first_last_layers_bf16": True}, "--first-last-layers-bf16: FP8 options other than --fp8-format with"),
    ({"fp8_recipe": "blockwise"}, "--fp8-recipe blockwise: only delayed, tensorwise, mxfp8 are modelled"),
    ({"tp_comm_overlap_rs_dgrad": True}, "--tp-comm-overlap-rs-dgrad: the model prices --tp-comm-overlap with"),
    ({"overlap_p2p_comm": False}, "--no-overlap-p2p-communication: the model prices Megatron's default"),
    ({"cp_comm_type": ["a2a+p2p"]}, "--cp-comm-type a2a+p2p: only p2p, a2a, allgather are modelled"),
    ({"mla_down_proj_fusion": True}, "--mla-down-proj-fusion: the fused multi-latent-attention down projection"),
    ({"position_embedding_type": "mrope"}, "--position-embedding-type mrope: only learned_absolute, rope, yarn, none"),
    ({"normalization": "GroupNorm"}, "--normalization GroupNorm: only LayerNorm, RMSNorm are modelled"),
    ({"transformer_impl": "inference_optimized"}, "--transformer-impl inference_optimized: only"),
    ({"optimizer": "sgd"}, "--optimizer sgd: only adam is modelled"),
])
def test_refused_values_name_flag_value_and_reason(values, message):
    (got,) = refused(**values)
    assert got.startswith(message), got


@pytest.mark.parametrize("values", [
    {"num_experts": None}, {"num_experts": 64, "expert_model_parallel_size": 8}, {"context_parallel_size": 4},
    {"cp_comm_type": ["a2a"]}, {"moe_router_topk": 2}, {"moe_aux_loss_coeff": 1e-2},
    {"position_embedding_type": "rope"}, {"normalization": "RMSNorm"}, {"transformer_impl": "local"},
    {"lr": 3e-4, "seed": 7, "num_layers": 96},
])
def test_defaults_and_modelled_values_are_accepted(values):
    assert refused(**values) == []


def test_enum_values_count_by_name():
    backend = enum.Enum("AttnBackend", "flash fused unfused local auto sparse")
    assert refused(attention_backend=backend.flash) == []
    assert refused(attention_backend=backend.sparse) == [
        f"--attention-backend sparse: only {', '.join(ALLOWED_VALUES['attention_backend'])} are modelled"]


def test_every_refusal_is_reported_and_absent_arguments_are_defaults():
    assert len(refused(moe_shared_expert_gate=True, tp_comm_split_ag=False, fp4_quantizer_factory="q.f")) == 3
    assert refusals({"fp4_quantizer_factory": "q.f"})
    assert not refusals({"save": "/ckpt", "auto_parallel": True, "fp8": "e4m3"})
    with pytest.raises(PipetteError, match="^--moe-shared-expert-gate: this mixture-of-experts option is not modelled; "
                                           "--use-torch-fsdp2: fully sharded data parallelism"):
        check_priced({"moe_shared_expert_gate": True, "use_torch_fsdp2": True, "lr": 0.1})
    check_priced({"num_experts": 8, "context_parallel_size": 2, "lr": 0.1})


def test_value_checked_arguments_are_in_the_table():
    table = flag_table()
    assert set(ALLOWED_VALUES) <= table.modelled | table.neutral
