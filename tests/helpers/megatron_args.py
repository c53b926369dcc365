"""Megatron's parsed arguments as the hook sees them, for the torch-free translation tests."""

from types import SimpleNamespace


def megatron_namespace(**kw) -> SimpleNamespace:
    """The tiny GPT's arguments as Megatron parses them, with `kw` replacing some."""
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, global_batch_size=16,
                ffn_hidden_size=None, kv_channels=None, group_query_attention=False, num_query_groups=None,
                swiglu=False, vocab_size=1024, padded_vocab_size=None, make_vocab_size_divisible_by=128,
                untie_embeddings_and_output_weights=True, position_embedding_type="learned_absolute",
                max_position_embeddings=64, normalization="LayerNorm", add_bias_linear=True,
                attention_dropout=0.1, hidden_dropout=0.1, attention_backend="auto", bf16=True, fp16=False,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, micro_batch_size=1,
                num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
                recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                sequence_parallel=False, use_distributed_optimizer=False, overlap_grad_reduce=False,
                overlap_param_gather=False, transformer_impl="local", load=None, use_checkpoint_args=False,
                ckpt_format="torch", dist_ckpt_optim_fully_reshardable=False,
                num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None,
                moe_layer_freq=1, moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
                moe_token_dispatcher_type="allgather", context_parallel_size=1, cp_comm_type=["p2p"],
                expert_model_parallel_size=1, expert_tensor_parallel_size=None, fp8=None, fp8_recipe="delayed",
                bias_gelu_fusion=True, bias_swiglu_fusion=True)
    return SimpleNamespace(**{**base, **kw})
