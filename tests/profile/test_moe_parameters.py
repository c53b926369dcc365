"""The workload's parameter counts of MoE, multi-latent-attention and --qk-layernorm models
against megatron-core's own GPTModel, built on CPU.

Megatron's "Number of parameters in transformer block" is this sum over the decoder's
parameters; building the model is the reference that cannot drift from it.
"""

import pytest
import torch

from megatron_pipette.profile.runtime import single_device_megatron
from megatron_pipette.spec.workload import Workload

pytestmark = pytest.mark.megatron

CASES = [
    # every layer MoE, SwiGLU, RMSNorm, no biases, untied output (Mixtral-like, shrunk)
    dict(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
         ffn_hidden_size=96, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
         untie_embeddings_and_output_weights=True, position_embedding_type="rope", num_experts=4, moe_router_topk=2),
    # every other layer MoE, a shared expert and a narrower expert FFN (DeepSeek-like, shrunk), GELU
    dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, num_experts=8, moe_router_topk=2,
         moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=64, moe_layer_freq=2, add_bias_linear=False),
    # Megatron's list form of the layer pattern; router and expert biases (which run unfused only)
    dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_experts=4, moe_layer_freq="([0]+[1]*3)",
         bias_gelu_fusion=False),
    # DeepSeek-V3-like, shrunk: MLA with a query latent and latent norms, the first layer dense
    dict(num_layers=3, hidden_size=64, num_attention_heads=4, multi_latent_attention=True, q_lora_rank=24,
         kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=12, qk_layernorm=True, ffn_hidden_size=96,
         swiglu=True, normalization="RMSNorm", add_bias_linear=False, untie_embeddings_and_output_weights=True,
         position_embedding_type="rope", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
         moe_shared_expert_intermediate_size=32, moe_layer_freq="([0]+[1]*2)"),
    # dense MLA without a query latent or norms, LayerNorm and biases (only the output projection's)
    dict(num_layers=2, hidden_size=64, num_attention_heads=4, multi_latent_attention=True, kv_lora_rank=16,
         qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8),
    # standard attention with --qk-layernorm (a query and a key norm of one head's width)
    dict(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
         qk_layernorm=True),
]


class NoParameters(torch.nn.Module):
    """Stands in for a parameter-free module that cannot be built on CPU."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def megatron_decoder_parameters(w: Workload) -> tuple[int, int]:
    """(decoder parameters, whole-model parameters) of megatron-core's GPTModel for this workload
    (its MTP block too, where --mtp-num-layers)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    pattern = [int(x) for x in w.moe_layer_pattern()] if w.num_experts else 1
    mla = dict(multi_latent_attention=True, q_lora_rank=w.q_lora_rank, kv_lora_rank=w.kv_lora_rank,
               qk_head_dim=w.qk_head_dim, qk_pos_emb_head_dim=w.qk_pos_emb_head_dim, v_head_dim=w.v_head_dim,
               rope_type="rope")  # (yarn, the default, builds its table on a GPU; no parameters either way)
    config = (MLATransformerConfig if w.multi_latent_attention else TransformerConfig)(
        **(mla if w.multi_latent_attention else {}), qk_layernorm=w.qk_layernorm,
        num_layers=w.num_layers, hidden_size=w.hidden_size, num_attention_heads=w.num_attention_heads,
        num_query_groups=w.query_groups, ffn_hidden_size=w.ffn, kv_channels=w.head_dim,
        gated_linear_unit=w.swiglu, activation_func=torch.nn.functional.silu if w.swiglu else torch.nn.functional.gelu,
        normalization=w.normalization, add_bias_linear=w.add_bias_linear, num_moe_experts=w.num_experts,
        moe_router_topk=w.moe_router_topk, moe_ffn_hidden_size=w.moe_ffn if w.num_experts else None,
        moe_shared_expert_intermediate_size=w.moe_shared_expert_intermediate_size, moe_layer_freq=pattern,
        mtp_num_layers=w.mtp_num_layers, params_dtype=torch.float32, use_cpu_initialization=True,
        perform_initialization=False)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=w.normalization)
    if w.multi_latent_attention:  # the local DotProductAttention takes no MLA head widths; it has no parameters
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = NoParameters
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if w.mtp_num_layers else None
    model = GPTModel(config, spec, vocab_size=w.padded_vocab_size(1), max_sequence_length=w.max_positions,
                     position_embedding_type=w.position_embedding_type,
                     share_embeddings_and_output_weights=not w.untie_embeddings_and_output_weights, mtp_block_spec=mtp)
    decoder = sum(p.numel() for p in model.decoder.parameters())
    return decoder, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("fields", CASES, ids=["mixtral-like", "deepseek-like", "list-pattern", "deepseek-v3-like",
                                                "mla-dense", "qk-layernorm"])
def test_parameter_counts_match_megatron(fields, monkeypatch):
    w = Workload(seq_length=64, global_batch_size=8, vocab_size=1000, **fields)
    # megatron-core's MLA builds its rotary table on the current CUDA device whatever
    # use_cpu_initialization says; the table holds no parameters.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    with single_device_megatron(torch.device("cpu")):
        decoder, total = megatron_decoder_parameters(w)
    ours_decoder = sum(w.layer_parameters(moe) for moe in w.moe_layer_pattern()) + w.norm_parameters()
    assert ours_decoder == decoder
    assert w.total_parameters() == total



@pytest.mark.parametrize("fields", [CASES[0], CASES[1], CASES[5]], ids=["mixtral-like", "deepseek-like", "dense"])
@pytest.mark.parametrize("mtp", [1, 2])
def test_mtp_parameter_counts_match_megatron(fields, mtp, monkeypatch):
    """--mtp-num-layers: each MTP layer a layer of the last decoder layer's kind, two norms, the 2h-to-h
    projection and a final norm, sharing the embedding and the output layer (one pipeline stage)."""
    w = Workload(seq_length=64, global_batch_size=8, vocab_size=1000, mtp_num_layers=mtp, **fields)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    with single_device_megatron(torch.device("cpu")):
        _, total = megatron_decoder_parameters(w)
    assert w.total_parameters() == total
