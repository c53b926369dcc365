"""Megatron-core modules with the per-rank shapes of a tensor-parallel size, on one device.

A TP rank of Megatron holds heads/TP attention heads, query-groups/TP key-value
groups, ffn/TP MLP columns and vocab/TP embedding rows, with the hidden size
unchanged. Building the layer with a TransformerConfig of those divided sizes and
`tensor_model_parallel_size=1` gives exactly one rank's GEMM shapes and saved
activations without needing TP peers; the TP collectives (all-reduce, or SP's
all-gather/reduce-scatter) are left out and modelled by the planner.

The layer spec is Megatron's: Transformer Engine's when it imports, else the local
spec. Fusions follow Megatron-LM's training defaults (bias-activation and
bias-dropout-add everywhere; masked softmax and RoPE fusion on a GPU, which
need CUDA kernels: the masked softmax only where its Apex kernels import, as
megatron-core imports them mid-forward and fails without them; RoPE fusion
with Transformer Engine). The unfused attention's softmax runs in the input
precision, as Megatron-LM's --attention-softmax-in-fp32 defaults to off
(TransformerConfig's own default is on, which would save an fp32 copy of the
scores). They matter for memory, not only time: the fused SwiGLU
saves its input and recomputes the activation in backward, the unfused one
keeps three more ffn-wide tensors. On a CPU the runtime runs these
torch.compile'd functions eagerly (profile.runtime), so the saved tensors are
the GPU's without minutes of C++ compilation. Gradient-accumulation fusion is
off: it accumulates into DDP's `main_grad`, which a bare module has not got.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_pipette.spec.workload import Workload

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Modules whose saved activations sequence parallelism shards over TP: the norms (and
# the LN-fused input linears of the TE spec), the inputs the QKV/FC1 linears save
# (Megatron keeps the s/TP shard and re-gathers it in backward), and the layer's own
# bias-dropout-add and residual (the block, for the input full recompute saves).
SEQUENCE_SHARDED_MODULES = frozenset({
    "", "layers.0", "layers.0.input_layernorm", "layers.0.pre_mlp_layernorm",
    "layers.0.self_attention.linear_qkv", "layers.0.mlp.linear_fc1",
})


def fused_softmax(device: torch.device) -> bool:
    """Whether Megatron's masked-softmax fusion can run: on a GPU with the CUDA kernels
    (Apex, or Megatron-LM's own build) its FusedScaleMaskSoftmax imports when it picks them."""
    return device.type == "cuda" and all(
        importlib.util.find_spec(m) is not None
        for m in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"))


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken TE install is the same as none for us
        return False
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


@dataclass
class Step:
    """One part ready to run: forward() returns the tensor backward starts from."""

    module: torch.nn.Module
    forward: Callable[[], torch.Tensor]
    output_grad: Callable[[torch.Tensor], torch.Tensor | None]
    """The gradient to start backward with (None for a scalar loss)."""
    shared: tuple[torch.Tensor, ...] = ()
    """Inputs every layer shares (mask, RoPE table): not this micro-batch's activations."""
    reset: Callable[[], None] = lambda: None
    """Drops the input's gradient between iterations."""
    again: Callable[[torch.Tensor], torch.Tensor] | None = None
    """The same part applied to its own output, as a stack of layers runs (None: a part that runs once
    per micro-batch): on a GPU the profiler times chains of two and four calls (measure.time_step)."""


def _activation(workload: Workload) -> Any:
    """The MLP's activation as Megatron-LM sets it (training/argument_utils.py)."""
    if workload.quick_geglu:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
        return quick_gelu
    return torch.nn.functional.silu if workload.swiglu else torch.nn.functional.gelu


def layer_config(workload: Workload, tp: int, recompute: str | None, device: torch.device, te: bool) -> Any:
    """The TransformerConfig of one TP rank's layer (see the module docstring)."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = device.type == "cuda"
    recompute_kw: dict[str, Any] = {"recompute_granularity": recompute}
    if recompute == "full":
        recompute_kw.update(recompute_method="uniform", recompute_num_layers=1)
    config = TransformerConfig(
        num_layers=1, hidden_size=workload.hidden_size,
        num_attention_heads=workload.num_attention_heads // tp, num_query_groups=workload.query_groups // tp,
        ffn_hidden_size=workload.ffn // tp, kv_channels=workload.head_dim,
        gated_linear_unit=workload.gated_linear_unit, activation_func=_activation(workload),
        normalization=workload.normalization, add_bias_linear=workload.add_bias_linear,
        add_qkv_bias=workload.add_bias_linear,
        hidden_dropout=workload.hidden_dropout, attention_dropout=workload.attention_dropout,
        bf16=workload.precision == "bf16", fp16=workload.precision == "fp16",
        params_dtype=DTYPES[workload.precision], pipeline_dtype=DTYPES[workload.precision],
        tensor_model_parallel_size=1, sequence_parallel=False,
        use_cpu_initialization=device.type == "cpu",
        bias_activation_fusion=workload.bias_activation_fusion,
        bias_dropout_fusion=True, masked_softmax_fusion=fused_softmax(device),
        attention_softmax_in_fp32=False,
        apply_rope_fusion=cuda and te and workload.position_embedding_type in ("rope", "yarn"),
        gradient_accumulation_fusion=False,
        attention_backend=AttnBackend[workload.attention_backend] if te else AttnBackend.local,
        **recompute_kw,
    )
    if workload.position_embedding_type == "yarn":
        # What training/argument_utils.py (_apply_yarn_config_from_args) sets: the attention scales
        # RoPE's cosines and sines by YaRN's concentration factor, unfused where it is not 1.
        config.yarn_rotary_scaling_factor = workload.rotary_scaling_factor
        config.yarn_mscale, config.yarn_mscale_all_dim = workload.mscale, workload.mscale_all_dim
    return config


def layer_step(workload: Workload, tp: int, mbs: int, recompute: str | None, env: Any, te: bool) -> Step:
    """One transformer layer (a one-layer TransformerBlock, so full recompute is Megatron's own)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlock

    device, dtype, s = env.device, DTYPES[workload.precision], workload.seq_length
    config = layer_config(workload, tp, recompute, device, te)
    spec = (get_gpt_layer_with_transformer_engine_spec() if te
            else get_gpt_layer_local_spec(normalization=workload.normalization))
    # Megatron's Float16Module casts every parameter (the torch norms' too) to the training dtype.
    block = TransformerBlock(config, spec, pre_process=True, post_process=False,
                             pg_collection=env.pg_collection).to(device=device, dtype=dtype).train()
    x = torch.randn(s, mbs, workload.hidden_size, device=device, dtype=dtype, requires_grad=True)
    shared: list[torch.Tensor] = []
    # The local spec's unfused attention needs the causal mask GPTModel gets from the data
    # loader (its default mask would be made on "cuda"); TE builds its own.
    mask = None if te else torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
    rope = _rope_table(workload, device) if workload.position_embedding_type in ("rope", "yarn") else None
    shared += [t for t in (mask, rope) if t is not None]
    grad = torch.randn_like(x)

    def forward() -> torch.Tensor:
        return block(x, attention_mask=mask, rotary_pos_emb=rope)

    def reset() -> None:
        x.grad = None

    def again(out: torch.Tensor) -> torch.Tensor:
        return block(out, attention_mask=mask, rotary_pos_emb=rope)

    return Step(module=block, forward=forward, output_grad=lambda out: grad, shared=tuple(shared), reset=reset,
                again=again)


def embedding_step(workload: Workload, tp: int, mbs: int, env: Any, te: bool) -> Step:
    """Word (vocab/TP rows) and position embeddings with dropout, as GPTModel's pre-process."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    device, dtype, s = env.device, DTYPES[workload.precision], workload.seq_length
    config = layer_config(workload, tp, None, device, te)
    rows = workload.padded_vocab_size(tp) // tp
    embedding = LanguageModelEmbedding(config=config, vocab_size=rows, max_sequence_length=workload.max_positions,
                                       position_embedding_type=workload.position_embedding_type,
                                       tp_group=env.pg_collection.tp).to(device=device, dtype=dtype).train()
    ids = torch.randint(0, rows, (mbs, s), device=device)
    positions = torch.arange(s, device=device).unsqueeze(0).expand(mbs, s)
    grad = torch.randn(s, mbs, workload.hidden_size, device=device, dtype=dtype)

    def forward() -> torch.Tensor:
        return embedding(input_ids=ids, position_ids=positions)

    return Step(module=embedding, forward=forward, output_grad=lambda out: grad)


def output_step(workload: Workload, tp: int, mbs: int, env: Any, te: bool) -> Step:
    """The last stage's extra work: final norm, the vocab/TP logits GEMM and vocab-parallel cross entropy."""
    from megatron.core import tensor_parallel
    from megatron.core.models.backends import LocalSpecProvider

    device, s, h = env.device, workload.seq_length, workload.hidden_size
    config = layer_config(workload, tp, None, device, te)
    if te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
        provider: Any = TESpecProvider()
    else:
        provider = LocalSpecProvider()
    norm_cls = provider.layer_norm(rms_norm=workload.normalization == "RMSNorm", for_qk=False)
    cols = workload.padded_vocab_size(tp) // tp
    module = torch.nn.Module()
    module.final_layernorm = norm_cls(config=config, hidden_size=h, eps=config.layernorm_epsilon)
    module.output_layer = tensor_parallel.ColumnParallelLinear(
        h, cols, config=config, init_method=config.init_method, bias=False, skip_bias_add=False,
        gather_output=False, tp_group=env.pg_collection.tp)
    module.to(device=device, dtype=DTYPES[workload.precision]).train()
    x = torch.randn(s, mbs, h, device=device, dtype=DTYPES[workload.precision], requires_grad=True)
    labels = torch.randint(0, cols, (s, mbs), device=device)

    if workload.cross_entropy_loss_fusion:    # Megatron's choice in compute_language_model_loss
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy as cross_entropy
    else:
        cross_entropy = tensor_parallel.vocab_parallel_cross_entropy

    def forward() -> torch.Tensor:
        logits, _ = module.output_layer(module.final_layernorm(x))
        return cross_entropy(logits, labels, tp_group=env.pg_collection.tp).sum()

    def reset() -> None:
        x.grad = None

    return Step(module=module, forward=forward, output_grad=lambda out: None, reset=reset)


def _rope_table(workload: Workload, device: torch.device) -> torch.Tensor:
    """RotaryEmbedding's table [s, 1, 1, head_dim] (base 10000, full rotary, not interleaved; YaRN's
    differs in its frequencies, not in the work).

    Computed here because megatron's RotaryEmbedding moves its frequencies to CUDA; the
    table is shared by all layers, so it is not part of a layer's cost.
    """
    d = workload.head_dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    freqs = torch.outer(torch.arange(workload.seq_length, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
