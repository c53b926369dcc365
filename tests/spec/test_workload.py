import pytest

from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.workload import Workload, model_presets, workload_from_preset


def gpt(**kw):
    base = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, global_batch_size=512)
    return Workload(**{**base, **kw})


def test_megatron_derived_values():
    w = gpt()
    assert w.ffn == 4 * 2048 and w.head_dim == 128 and w.query_groups == 16
    # Megatron's SwiGLU rule: int((4h * 2/3) / 64) * 64
    assert gpt(hidden_size=4096, num_attention_heads=32, swiglu=True).ffn == 10880
    assert gpt(ffn_hidden_size=5000).ffn == 5000


def test_vocab_padding_follows_megatron():
    w = gpt(vocab_size=50257)
    assert w.padded_vocab_size(1) == 50304
    assert w.padded_vocab_size(8) == 51200  # multiple of 128 * 8
    assert w.padded_vocab_size(3) % (128 * 3) == 0


def test_parameter_counts_match_published_sizes():
    assert abs(workload_from_preset("gpt3-175b").total_parameters() / 1e9 - 174.6) < 0.5
    assert abs(workload_from_preset("llama2-7b").total_parameters() / 1e9 - 6.74) < 0.02
    assert abs(workload_from_preset("llama2-70b").total_parameters() / 1e9 - 68.98) < 0.1


def test_model_flops_match_megatron_formula():
    """megatron-core 0.19's num_floating_point_operations (training/training.py) counts the core
    attention over the causal half of the scores: Korthikanti et al.'s 72 b s L h^2 (1 + s/(6h) +
    V/(12 h L)) with s/(12h) for the attention term."""
    w = workload_from_preset("gpt3-175b")
    b, s, L, h, V = w.global_batch_size, w.seq_length, w.num_layers, w.hidden_size, w.padded_vocab_size(1)
    megatron = 72 * b * s * L * h * h * (1 + s / (12 * h) + V / (12 * h * L))
    assert w.model_flops_per_iteration() == pytest.approx(megatron, rel=1e-12)
    gqa = workload_from_preset("llama3-8b")        # GQA, SwiGLU: Megatron's terms written out
    t = gqa.global_batch_size * gqa.seq_length
    q, kv = gqa.num_attention_heads * gqa.head_dim, 2 * gqa.query_groups * gqa.head_dim
    per_token = 6 * (gqa.hidden_size * (q + kv) + q * gqa.hidden_size) + 6 * q / 2 * 2 * gqa.seq_length \
        + 6 * gqa.hidden_size * gqa.ffn * 3
    logits = 6 * gqa.hidden_size * gqa.padded_vocab_size(1)
    assert gqa.model_flops_per_iteration() == pytest.approx(t * (gqa.num_layers * per_token + logits), rel=1e-12)


def test_all_presets_build():
    for name in model_presets():
        assert workload_from_preset(name).total_parameters() > 0


@pytest.mark.parametrize("kw, flag", [
    (dict(num_attention_heads=15), "--num-attention-heads"),
    (dict(num_layers=0), "--num-layers"),
    (dict(global_batch_size=-4), "--global-batch-size"),
    (dict(precision="fp8"), "--precision"),
    (dict(group_query_attention=True), "--num-query-groups"),
    (dict(group_query_attention=True, num_query_groups=5), "--num-query-groups"),
    (dict(num_query_groups=4), "--group-query-attention"),
    (dict(hidden_dropout=1.5), "--hidden-dropout"),
])
def test_bad_input_names_the_flag(kw, flag):
    with pytest.raises(PipetteError, match=flag):
        gpt(**kw)


def test_unknown_preset():
    with pytest.raises(PipetteError, match="--model"):
        workload_from_preset("gpt5")


def test_derived_values_cached_on_a_workload_keep_it_picklable_and_equal():
    """The hook sends workloads between ranks by pickling; values derived once and kept on the
    instance must travel and leave equality and hashing to the fields."""
    import pickle

    w = workload_from_preset("deepseek-v3-like")
    fresh = workload_from_preset("deepseek-v3-like")
    w.attention_parameters(), w.attention_replicated_parameters(), w.moe_layer_pattern(), w.attention_linears()
    copy = pickle.loads(pickle.dumps(w))
    assert copy == w == fresh and hash(copy) == hash(fresh)
    assert copy.attention_linears() == fresh.attention_linears()
    assert w.attention_linears() is not w.attention_linears()     # a fresh dict: callers cannot alter the cache


@pytest.mark.parametrize("kw, message", [
    (dict(num_layers=1025), "--num-layers must be at most 1024, got 1025"),
    (dict(num_layers=10 ** 20), "--num-layers must be at most 1024"),
    (dict(global_batch_size=1 << 17), "--global-batch-size must be at most 65536"),
    (dict(hidden_size=1 << 30, num_attention_heads=1), "--hidden-size must be at most 1048576"),
    (dict(seq_length=10 ** 30), "--seq-length must be at most 16777216"),
    (dict(vocab_size=10 ** 9), "--vocab-size must be at most 16777216"),
    (dict(ffn_hidden_size=10 ** 9), "--ffn-hidden-size must be at most"),
    (dict(kv_channels=2 ** 21), "--kv-channels must be at most"),
    (dict(num_experts=2 ** 21), "--num-experts must be at most"),
    (dict(num_layers=True), "--num-layers must be a positive integer, got True"),
    (dict(num_layers=10 ** 5000), "--num-layers must be at most 1024, got an integer of 16610 bits"),
    (dict(attention_dropout="0.1"), "--attention-dropout must be in"),
    (dict(hidden_dropout=float("nan")), "--hidden-dropout must be in"),
    (dict(num_experts=4, swiglu=True, add_bias_linear=False, moe_expert_capacity_factor=float("inf")),
     "--moe-expert-capacity-factor must be a positive number"),
    (dict(num_experts=4, swiglu=True, add_bias_linear=False, moe_expert_capacity_factor=float("nan")),
     "--moe-expert-capacity-factor must be a positive number"),
])
def test_sizes_are_bounded_before_numpy_sees_them(kw, message):
    with pytest.raises(PipetteError, match=f"^{message}"):
        gpt(**kw)


def test_max_position_embeddings_below_seq_length_is_refused_as_megatron_does():
    with pytest.raises(PipetteError, match="--max-position-embeddings 1024 is below --seq-length 2048"):
        gpt(max_position_embeddings=1024)
    assert gpt(max_position_embeddings=4096).max_positions == 4096


@pytest.mark.parametrize("kw, refused", [
    (dict(), "--num-experts 4 with GELU experts and biases: megatron-core fuses a routed expert's bias"),
    (dict(swiglu=True), "--num-experts 4 --swiglu with biases: megatron-core's fused SwiGLU of routed experts"),
    (dict(swiglu=True, bias_gelu_fusion=False), "--num-experts 4 --swiglu with biases"),
    (dict(add_bias_linear=False, attention_backend="local"), None),
    (dict(swiglu=True, add_bias_linear=False), None),
    (dict(bias_gelu_fusion=False), None),                       # unfused expert biases, with Transformer Engine
    (dict(bias_gelu_fusion=False, attention_backend="local"), "--num-experts 4 with biases on Megatron's local layers"),
])
def test_expert_activations_megatron_cannot_run_are_refused_by_name(kw, refused):
    from megatron_pipette.errors import UnrunnableFlags

    if refused is None:
        assert gpt(num_experts=4, **kw).num_experts == 4
    else:
        with pytest.raises(UnrunnableFlags, match=f"^{refused}"):
            gpt(num_experts=4, **kw)


HYBRIDEP = dict(num_experts=4, swiglu=True, add_bias_linear=False, moe_token_dispatcher_type="flex",
                moe_flex_dispatcher_backend="hybridep")


@pytest.mark.parametrize("kw, message", [
    (dict(HYBRIDEP, moe_expert_rank_capacity_factor=1.5),
     "--moe-expert-rank-capacity-factor 1.5 with HybridEP needs --use-transformer-engine-op-fuser"),
    (dict(HYBRIDEP, moe_flex_dispatcher_backend="deepep", use_transformer_engine_op_fuser=True,
          moe_expert_rank_capacity_factor=1.5),
     "--moe-expert-rank-capacity-factor 1.5 needs --moe-token-dispatcher-type flex with --moe-flex-dispatcher-backend "
     "hybridep"),
    (dict(HYBRIDEP, use_transformer_engine_op_fuser=True, moe_paged_stash=True),
     "--moe-paged-stash needs --moe-expert-rank-capacity-factor"),
    (dict(HYBRIDEP, use_transformer_engine_op_fuser=True, moe_expert_rank_capacity_factor=0),
     "--moe-expert-rank-capacity-factor must be a positive number"),
    (dict(HYBRIDEP, use_transformer_engine_op_fuser=True, moe_expert_rank_capacity_factor=1.5, moe_paged_stash=True,
          moe_paged_stash_buffer_size_factor_cuda=float("nan")),
     "--moe-paged-stash-buffer-size-factor-cuda must be a number"),
])
def test_the_expert_rank_budget_and_the_paged_stash_take_what_megatron_asserts(kw, message):
    """megatron-core 0.19.2's TransformerConfig.__post_init__: the capacity factor needs the hybridep
    (or the unmodelled ncclep) backend and, with hybridep, the op fuser; the stash needs the factor."""
    with pytest.raises(PipetteError, match=f"^{message}"):
        gpt(**kw)
    ran = gpt(**HYBRIDEP, use_transformer_engine_op_fuser=True, moe_expert_rank_capacity_factor=1.5,
              moe_paged_stash=True, moe_paged_stash_buffer_size_factor_cuda=1.2,
              moe_paged_stash_buffer_size_factor_cpu=1.0)
    assert ran.moe_paged_stash and ran.moe_expert_rank_capacity_factor == 1.5


@pytest.mark.megatron
@pytest.mark.parametrize("kw", [dict(moe_expert_rank_capacity_factor=1.5),
                                dict(moe_paged_stash=True, use_transformer_engine_op_fuser=True)])
def test_megatron_refuses_what_the_workload_refuses(kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError):
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                          moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep", **kw)
    with pytest.raises(PipetteError):
        gpt(**HYBRIDEP, **kw)
