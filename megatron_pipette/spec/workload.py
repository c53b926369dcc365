"""The workload: model and training settings, in Megatron-LM's argument names.

Fields are named exactly as Megatron's `args` (`--hidden-size` -> `hidden_size`)
so a user can paste the model part of a launch line. Properties fill the values
Megatron derives (ffn size, kv channels, query groups) by Megatron's own rules;
the padded vocabulary depends on the tensor-parallel size and is a function,
not a field. What a layout derives from the workload is in `spec.job`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from typing import Literal, get_args

from megatron_pipette.errors import PipetteError, UnrunnableFlags
from megatron_pipette.spec.expressions import MAX_INTEGER, in_range, list_expression, shown

Precision = Literal["fp32", "fp16", "bf16"]
PRECISIONS = get_args(Precision)
BYTES_PER_ELEMENT = {"fp32": 4, "fp16": 2, "bf16": 2}
AttentionBackend = Literal["auto", "flash", "fused", "unfused", "local"]
ATTENTION_BACKENDS = get_args(AttentionBackend)
Normalization = Literal["LayerNorm", "RMSNorm"]
NORMALIZATIONS = get_args(Normalization)
PositionEmbeddingType = Literal["learned_absolute", "rope", "yarn", "none"]
POSITION_EMBEDDINGS = get_args(PositionEmbeddingType)
MoeTokenDispatcherType = Literal["allgather", "alltoall", "flex"]
MOE_DISPATCHERS = get_args(MoeTokenDispatcherType)
"""--moe-token-dispatcher-type values the cost model prices (flex: the backends below)."""
MoeFlexDispatcherBackend = Literal["deepep", "hybridep"]
FLEX_BACKENDS = get_args(MoeFlexDispatcherBackend)
"""--moe-flex-dispatcher-backend values modelled: both send a token once to each remote node that
holds one of its experts and fan it out there over NVLink (ncclep is not modelled)."""
SoftmaxType = Literal["vanilla", "off-by-one", "learnable"]
SOFTMAX_TYPES = get_args(SoftmaxType)
CrossEntropyFusionImpl = Literal["native", "te"]
CROSS_ENTROPY_FUSION_IMPLS = get_args(CrossEntropyFusionImpl)
"""--cross-entropy-fusion-impl: megatron-core's compiled kernels, or Transformer Engine's Triton ones
(which Megatron 0.19 refuses beside --cross-entropy-loss-fusion; the releases NVIDIA's 2025-26
recipes ran accepted it)."""
Fp8Format = Literal["e4m3", "hybrid"]
FP8_FORMATS = get_args(Fp8Format)
Fp8Recipe = Literal["delayed", "tensorwise", "mxfp8"]
FP8_RECIPES = get_args(Fp8Recipe)
"""--fp8-recipe values the cost model prices: per-tensor scaling, and MXFP8's 32-element block
scaling (docs/fp8.md); blockwise (128-element blocks on Hopper) and custom are not modelled."""
Fp4Format = Literal["e2m1"]
FP4_FORMATS = get_args(Fp4Format)
Fp4Recipe = Literal["nvfp4"]
FP4_RECIPES = get_args(Fp4Recipe)
"""--fp4-recipe values the cost model prices: NVFP4's two-level block scaling (docs/fp8.md); custom
quantizers are not modelled."""
BLOCK_SCALES = {"mxfp8": 32, "nvfp4": 16}
"""Elements per one-byte block scale of each block-scaled recipe (Transformer Engine 2.20,
pytorch/constants.py): MXFP8 an E8M0 scale per 32 (MXFP8_BLOCK_SCALING_SIZE), NVFP4 an E4M3 scale
per 16 (NVFP4_BLOCK_SCALING_SIZE) beside a per-tensor FP32 scale (common/recipe NVFP4BlockScaling).
Per-tensor recipes keep one FP32 scale a tensor: nothing per element."""
ELEMENT_BYTES = {"nvfp4": 0.5}
"""Bytes of a quantised element where not one: NVFP4's E2M1, two to a byte."""
CudaGraphImpl = Literal["none", "local", "transformer_engine", "full_iteration"]
CUDA_GRAPH_IMPLS = get_args(CudaGraphImpl)
CudaGraphModule = Literal["attn", "mlp", "moe", "moe_router", "moe_preprocess"]
CUDA_GRAPH_MODULES = get_args(CudaGraphModule)
"""--cuda-graph-modules values the cost model prices (megatron-core 0.19.2's CudaGraphModule less
mamba, which needs Mamba layers). Megatron's deprecated spellings are read as its arguments.py reads
them: "full" alone is the empty list (the whole layer), "full_iteration" means --cuda-graph-impl
full_iteration, "full_iteration_inference" acts in inference only (cuda_graph_config.py)."""


def quantised_bytes(recipe: str) -> float:
    """Bytes an element of one quantised copy of a tensor takes, with its share of the block scales:
    1 (per-tensor FP8), 1 + 1/32 (MXFP8), 0.5 + 1/16 (NVFP4)."""
    block = BLOCK_SCALES.get(recipe)
    return 1 if block is None else ELEMENT_BYTES.get(recipe, 1) + 1 / block


OPTIMIZER_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
"""Dtypes --main-params-dtype, --main-grads-dtype, --exp-avg-dtype and --exp-avg-sq-dtype take
(megatron/training/arguments.py) and their bytes per element."""
OptimizerStateDtype = Literal["fp32", "bf16", "fp16", "fp8"]
"""--exp-avg-dtype and --exp-avg-sq-dtype: every one of OPTIMIZER_DTYPES."""
MainParamsDtype = Literal["fp32", "fp16"]
MainGradsDtype = Literal["fp32", "bf16"]
MoeRouterDtype = Literal["fp32", "fp64"]
FLAGS = {"fp8": "--fp8-format", "fp4": "--fp4-format"}
"""Argument names whose Megatron flag is not the name with dashes."""


MAX_SIZE = 1 << 20
"""The largest value of a width or count flag (hidden and FFN sizes, heads, experts, latent ranks):
dozens of times the largest published model's; bounded so that no input leaves numpy's integers
or keeps the search busy for ever."""
MAX_SIZES = {"num_layers": 1024, "global_batch_size": 1 << 16, "seq_length": 1 << 24,
             "max_position_embeddings": 1 << 24, "vocab_size": 1 << 24}
"""Flags bounded otherwise: layers (the deepest transformers trained, DeepNet's, have 1,000) and
the global batch (LAMB's 64K) drive the search's and the schedule model's work; sequences and
vocabularies of 16M tokens are beyond any model's."""


def check_count(field: str, value: object) -> None:
    """Raise PipetteError naming the flag unless `value` is an integer in 1..its bound (MAX_SIZES, else
    MAX_SIZE)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PipetteError(f"{megatron_flag(field)} must be a positive integer, got {shown(value)}")
    limit = MAX_SIZES.get(field, MAX_SIZE)
    if value > limit:
        raise PipetteError(f"{megatron_flag(field)} must be at most {limit}, got {shown(value)}")


def attention_backend_built(attention_backend: str, transformer_engine: bool) -> str:
    """The attention Megatron builds: without Transformer Engine's layer spec (--transformer-impl
    local, or TE not installed) it is the local DotProductAttention, which keeps the s x s scores
    whatever --attention-backend says."""
    return attention_backend if transformer_engine else "local"


def _yarn_mscale(scale: float, mscale: float) -> float:
    """megatron-core's _yarn_get_mscale (models/common/embeddings/yarn_rotary_pos_embedding.py)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def megatron_flag(field: str) -> str:
    """The Megatron-LM flag of an argument name: hidden_size -> --hidden-size."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A GPT-style decoder and its batch. Defaults are Megatron-LM's."""

    num_layers: int
    """--num-layers: transformer layers."""
    hidden_size: int
    """--hidden-size."""
    num_attention_heads: int
    """--num-attention-heads."""
    seq_length: int
    """--seq-length: tokens per sample."""
    global_batch_size: int
    """--global-batch-size: samples per iteration, over all data-parallel replicas."""
    ffn_hidden_size: int | None = None
    """--ffn-hidden-size; None: 4*hidden, or Megatron's SwiGLU rule int(8h/3/64)*64."""
    kv_channels: int | None = None
    """--kv-channels; None: hidden_size / num_attention_heads."""
    group_query_attention: bool = False
    """--group-query-attention."""
    num_query_groups: int | None = None
    """--num-query-groups; only with group_query_attention, else = heads."""
    multi_latent_attention: bool = False
    """--multi-latent-attention (MLA, DeepSeek-V2/V3): queries, keys and values come up from
    low-rank latents; the head dims below replace kv_channels, every head has its own K and V."""
    q_lora_rank: int | None = None
    """--q-lora-rank: the query latent's width; None: queries projected from the hidden state."""
    kv_lora_rank: int = 32
    """--kv-lora-rank: the key/value latent's width."""
    qk_head_dim: int = 128
    """--qk-head-dim: a query/key head's width without its rotary part."""
    qk_pos_emb_head_dim: int = 64
    """--qk-pos-emb-head-dim: a query/key head's rotary part (the key's shared by all heads)."""
    v_head_dim: int = 128
    """--v-head-dim: a value head's width."""
    qk_layernorm: bool = False
    """--qk-layernorm: norms on each head's query and key (MLA: on the query and key/value latents)."""
    swiglu: bool = False
    """--swiglu: gated MLP, three ffn-sized GEMMs instead of two."""
    quick_geglu: bool = False
    """--quick-geglu: gated MLP with a quick-GELU gate (GPT-OSS): the same GEMMs and kept tensors as
    --swiglu, another elementwise function (megatron/core/fusions/fused_bias_geglu.py)."""
    activation_func_clamp_value: float | None = None
    """--activation-func-clamp-value: a gated MLP's two halves clamped before the activation (GPT-OSS:
    7). Megatron's fused quick-GeGLU clamps and re-concatenates them in separate passes
    (fusions/fused_bias_geglu.py: weighted_bias_quick_geglu_impl); its fused SwiGLU ignores it."""
    mtp_num_layers: int | None = None
    """--mtp-num-layers: multi-token-prediction layers (DeepSeek-V3: 1) after the decoder, on the last
    pipeline stage's last model chunk; each embeds the next tokens, norms them and the decoder's
    output, projects the pair (2h to h), runs one layer of the last decoder layer's kind, and the
    final norm, output layer and loss again (megatron-core 0.19, transformer/multi_token_prediction.py)."""
    vocab_size: int = 50257
    """--vocab-size (or the tokenizer's size) before Megatron pads it."""
    make_vocab_size_divisible_by: int = 128
    """--make-vocab-size-divisible-by; Megatron pads to a multiple of this times TP."""
    untie_embeddings_and_output_weights: bool = False
    """--untie-embeddings-and-output-weights: a separate output matrix."""
    position_embedding_type: PositionEmbeddingType = "learned_absolute"
    """--position-embedding-type: learned_absolute adds max_position_embeddings*h parameters; rope
    and yarn (RoPE with YaRN's context extension, GPT-OSS) rotate the query and key heads."""
    rotary_scaling_factor: float = 1.0
    """--rotary-scaling-factor: YaRN's extension factor (GPT-OSS: 32); with --mscale and
    --mscale-all-dim it sets the concentration factor that scales YaRN's cosines and sines."""
    mscale: float = 1.0
    """--mscale (YaRN)."""
    mscale_all_dim: float = 0.0
    """--mscale-all-dim (YaRN)."""
    max_position_embeddings: int | None = None
    """--max-position-embeddings; None: seq_length."""
    normalization: Normalization = "LayerNorm"
    """--normalization: LayerNorm (weight+bias) or RMSNorm (weight)."""
    add_bias_linear: bool = True
    """Biases in the linear layers (Megatron default); --disable-bias-linear turns them off."""
    bias_gelu_fusion: bool = True
    """Megatron adds a GELU's bias inside its kernel; --no-bias-gelu-fusion turns that off. A kernel
    choice priced alike, but one routed experts cannot always run (see _check_expert_activation)."""
    bias_swiglu_fusion: bool = True
    """The same for SwiGLU; --no-bias-swiglu-fusion turns it off."""
    attention_dropout: float = 0.1
    """--attention-dropout: >0 keeps a dropout mask per attention score."""
    hidden_dropout: float = 0.1
    """--hidden-dropout: >0 keeps a dropout mask per hidden activation."""
    window_size: str | None = None
    """--window-size: sliding-window attention as Megatron's "left,right" keys (GPT-OSS: "127,0";
    -1: unbounded), on the layers --window-attn-skip-freq leaves windowed; None: full attention."""
    window_attn_skip_freq: int | str | None = None
    """--window-attn-skip-freq: every N-th layer (counted from 1) keeps full attention, or Megatron's
    list form ("[1,1,1,0]*3", 1: windowed); None: every layer is windowed."""
    softmax_type: SoftmaxType = "vanilla"
    """--softmax-type: vanilla, off-by-one or learnable (attention sinks, GPT-OSS): one extra logit
    in each softmax row, learnable with one parameter per head and layer."""
    attention_backend: AttentionBackend = "auto"
    """--attention-backend: auto/flash/fused keep no s*s score matrices."""
    precision: Precision = "fp32"
    """--bf16 / --fp16, else fp32 (Megatron's default): the dtype of parameters and activations."""
    cross_entropy_loss_fusion: bool = False
    """--cross-entropy-loss-fusion: a fused vocab-parallel cross entropy, of the implementation below."""
    cross_entropy_fusion_impl: CrossEntropyFusionImpl = "native"
    """--cross-entropy-fusion-impl, read with --cross-entropy-loss-fusion: native (megatron-core's
    compiled kernels: the same fp32 softmax kept for the backward, two tensor-parallel all-reduces
    instead of three) or te (Transformer Engine's: one pass over the logits each way, the
    statistics all-gathered)."""
    grad_reduce_in_bf16: bool = False
    """--grad-reduce-in-bf16: with --bf16, gradients are accumulated and reduced in bf16 instead of
    fp32 (half the gradient buffer and the data-parallel traffic); no effect otherwise, as in Megatron."""
    fp8: Fp8Format | None = None
    """--fp8-format: e4m3, or hybrid (e5m2 gradients): the transformer layers' linears run FP8 GEMMs
    through Transformer Engine, the rest in the training dtype; None: no FP8."""
    fp8_recipe: Fp8Recipe = "delayed"
    """--fp8-recipe: delayed or tensorwise (per-tensor) scaling, or mxfp8 (an E8M0 scale per 32
    elements, Blackwell's block-scaled GEMMs)."""
    fp8_param_gather: bool = False
    """--fp8-param-gather: the layers' linear weights are kept in FP8 (Transformer Engine's FP8
    primary weights: 1 byte, plus the transpose Hopper's FP8 GEMMs need) instead of 16-bit weights
    and their FP8 copies, and the distributed optimizer all-gathers them in FP8 (MXFP8: in 16 bits,
    see param_gather_bytes)."""
    fp4: Fp4Format | None = None
    """--fp4-format: e2m1, the transformer layers' linears run NVFP4 GEMMs through Transformer Engine
    (forward, data and weight gradients), the rest in bf16; None: no FP4. Excludes --fp8-format."""
    fp4_recipe: Fp4Recipe = "nvfp4"
    """--fp4-recipe: nvfp4 (an E4M3 scale per 16 elements and a per-tensor FP32 scale)."""
    fp4_param_gather: bool = False
    """--fp4-param-gather: the layers' linear weights are kept in NVFP4 instead of bf16 weights and
    their NVFP4 copies, and the distributed optimizer all-gathers them packed, two to a byte."""
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """--reuse-grad-buf-for-mxfp8-param-ag: with --fp8-param-gather under --fp8-recipe mxfp8, the
    distributed optimizer all-gathers the 16-bit weights into the gradient buffer and quantises them
    from there, so no 16-bit parameter buffer is kept."""
    use_precision_aware_optimizer: bool = False
    """--use-precision-aware-optimizer: Transformer Engine's FusedAdam keeps the optimizer state in
    the dtypes below and reads the gradients in their own dtype (no fp32 copy for the step)."""
    main_params_dtype: MainParamsDtype = "fp32"
    """--main-params-dtype: the optimizer's master copy of the weights (fp32 or fp16)."""
    main_grads_dtype: MainGradsDtype = "fp32"
    """--main-grads-dtype: the gradients the optimizer reads (fp32 or bf16)."""
    exp_avg_dtype: OptimizerStateDtype = "fp32"
    """--exp-avg-dtype: Adam's first moment (fp32, fp16, bf16 or fp8)."""
    exp_avg_sq_dtype: OptimizerStateDtype = "fp32"
    """--exp-avg-sq-dtype: Adam's second moment (fp32, fp16, bf16 or fp8)."""
    num_experts: int | None = None
    """--num-experts: routed experts in each MoE layer; None: a dense model."""
    moe_router_topk: int = 2
    """--moe-router-topk: experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """--moe-ffn-hidden-size: one routed expert's FFN width; None: --ffn-hidden-size."""
    moe_shared_expert_intermediate_size: int | None = None
    """--moe-shared-expert-intermediate-size: the shared experts' total FFN width; None: no shared expert."""
    moe_layer_freq: int | str = 1
    """--moe-layer-freq: every N-th layer is MoE (layer 0 always), or Megatron's list form "([0]+[1]*23)"."""
    moe_expert_capacity_factor: float | None = None
    """--moe-expert-capacity-factor: tokens an expert takes, x the balanced share; None: dropless."""
    moe_pad_expert_input_to_capacity: bool = False
    """--moe-pad-expert-input-to-capacity: every expert computes its full capacity."""
    moe_token_dispatcher_type: MoeTokenDispatcherType = "allgather"
    """--moe-token-dispatcher-type: allgather (over TP x EP), alltoall (over EP) or flex (one group
    over expert TP x EP, each token sent once per remote node: --moe-flex-dispatcher-backend)."""
    moe_flex_dispatcher_backend: MoeFlexDispatcherBackend = "deepep"
    """--moe-flex-dispatcher-backend: deepep or hybridep (with --moe-token-dispatcher-type flex)."""
    moe_enable_deepep: bool = False
    """--moe-enable-deepep: megatron-core's deprecated spelling of --moe-flex-dispatcher-backend deepep
    (TransformerConfig sets the backend from it), with the flex dispatcher only."""
    moe_router_num_groups: int | None = None
    """--moe-router-num-groups: experts split into this many groups for group-limited routing
    (DeepSeek-V3's node-limited routing sets it to the nodes of the EP group); None: no limit."""
    moe_router_group_topk: int | None = None
    """--moe-router-group-topk: groups each token may route to."""
    moe_router_dtype: MoeRouterDtype | None = None
    """--moe-router-dtype: fp32 or fp64 router logits, and so routing probabilities (kept for the
    experts' weighted activation); None: the training dtype."""
    moe_expert_rank_capacity_factor: float | None = None
    """--moe-expert-rank-capacity-factor: HybridEP's static budget of rows an expert rank receives,
    x the tokens a rank routes (T k, rounded up to 256 rows): the experts' buffers and what they
    keep for the backward are that many rows; the GEMMs run on the rows received. Tokens beyond it
    are dropped and the step rerun dropless. None: buffers sized to the rows received."""
    moe_paged_stash: bool = False
    """--moe-paged-stash: the routed experts' saved activations are copied, page by page, into one
    device buffer sized for the rows in flight (not the budget's), and copied back for the backward."""
    moe_paged_stash_buffer_size_factor_cuda: float = 1.10
    """--moe-paged-stash-buffer-size-factor-cuda: that buffer, x the peak over the step of the rows in
    flight, counted at the budget / the capacity factor (positive) or as received (negative)."""
    moe_paged_stash_buffer_size_factor_cpu: float = 0.0
    """--moe-paged-stash-buffer-size-factor-cpu: a pinned host buffer, sized alike, the stash spills
    into where the device one is full (host memory, not priced); 0: none."""
    use_transformer_engine_op_fuser: bool = False
    """--use-transformer-engine-op-fuser: Transformer Engine's fused operations (the routed experts'
    fused grouped MLP); Megatron needs it for HybridEP's capacity factor."""
    cuda_graph_impl: CudaGraphImpl = "none"
    """--cuda-graph-impl: none, local (megatron-core's per-layer graphs), transformer_engine (TE's
    make_graphed_callables per layer) or full_iteration (one graph for the forward-backward of the
    whole iteration, the optimizer step excluded): the captured kernels cost no host launch each
    (cost.launch)."""
    cuda_graph_modules: tuple[CudaGraphModule, ...] = ()
    """--cuda-graph-modules: what the per-layer graphs capture (attn, mlp, moe, moe_router,
    moe_preprocess); empty: the whole layer. Meaningless (and empty) under full_iteration."""
    name: str = "custom"
    """A label for reports; not a Megatron flag."""

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                      "global_batch_size", "vocab_size", "make_vocab_size_divisible_by"):
            check_count(field, getattr(self, field))
        for field in ("ffn_hidden_size", "kv_channels", "num_query_groups", "max_position_embeddings", "q_lora_rank",
                      "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "moe_router_num_groups",
                      "moe_router_group_topk", "mtp_num_layers"):
            if getattr(self, field) is not None:
                check_count(field, getattr(self, field))
        if self.moe_router_dtype not in (None, *get_args(MoeRouterDtype)):
            raise PipetteError(f"--moe-router-dtype must be fp32 or fp64, got {self.moe_router_dtype!r}")
        if self.max_position_embeddings is not None and self.max_position_embeddings < self.seq_length:
            raise PipetteError(f"--max-position-embeddings {self.max_position_embeddings} is below --seq-length "
                               f"{self.seq_length} (Megatron requires max_position_embeddings >= seq_length)")
        for field, allowed in (("precision", PRECISIONS), ("attention_backend", ATTENTION_BACKENDS),
                               ("normalization", NORMALIZATIONS), ("position_embedding_type", POSITION_EMBEDDINGS),
                               ("fp8_recipe", FP8_RECIPES), ("moe_token_dispatcher_type", MOE_DISPATCHERS),
                               ("moe_flex_dispatcher_backend", FLEX_BACKENDS), ("softmax_type", SOFTMAX_TYPES),
                               ("cross_entropy_fusion_impl", CROSS_ENTROPY_FUSION_IMPLS), ("fp4_recipe", FP4_RECIPES)):
            if getattr(self, field) not in allowed:
                raise PipetteError(f"{megatron_flag(field)} must be one of {', '.join(allowed)}, "
                                   f"got {getattr(self, field)!r}")
        if not in_range(self.rotary_scaling_factor, 0, above=True):
            raise PipetteError("--rotary-scaling-factor must be a positive number, "
                               f"got {shown(self.rotary_scaling_factor)}")
        for field in ("mscale", "mscale_all_dim"):
            if not in_range(getattr(self, field), -math.inf):
                raise PipetteError(f"{megatron_flag(field)} must be a number, got {shown(getattr(self, field))}")
        if _yarn_mscale(self.rotary_scaling_factor, self.mscale_all_dim) == 0:
            raise PipetteError(f"--mscale-all-dim {self.mscale_all_dim} makes YaRN's concentration factor divide "
                               f"by zero at --rotary-scaling-factor {self.rotary_scaling_factor}")
        clamp = self.activation_func_clamp_value
        if clamp is not None and not in_range(clamp, 0, above=True):
            raise PipetteError(f"--activation-func-clamp-value must be a positive number, got {shown(clamp)}")
        for field in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, field)
            if not (isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value < 1.0):
                raise PipetteError(f"{megatron_flag(field)} must be in [0, 1), got {getattr(self, field)!r}")
        if self.kv_channels is None and not self.multi_latent_attention and self.hidden_size % self.num_attention_heads:
            raise PipetteError(f"--hidden-size {self.hidden_size} is not divisible by "
                               f"--num-attention-heads {self.num_attention_heads}")
        if self.multi_latent_attention and self.group_query_attention:
            raise PipetteError("--multi-latent-attention and --group-query-attention exclude each other "
                               "(as in Megatron)")
        if self.num_query_groups is not None and not self.group_query_attention:
            raise PipetteError("--num-query-groups needs --group-query-attention")
        if self.group_query_attention:
            if self.num_query_groups is None:
                raise PipetteError("--group-query-attention needs --num-query-groups")
            if self.num_attention_heads % self.num_query_groups:
                raise PipetteError(f"--num-attention-heads {self.num_attention_heads} is not divisible "
                                   f"by --num-query-groups {self.num_query_groups}")
        if self.mtp_num_layers and self.position_embedding_type == "yarn":
            raise PipetteError("--mtp-num-layers with --position-embedding-type yarn: Megatron asserts multi-token "
                               "prediction takes learned_absolute, rope, mrope or none (validate_args)")
        if self.swiglu and self.quick_geglu:
            raise PipetteError("--quick-geglu and --swiglu exclude each other (Megatron asserts not args.swiglu)")
        self.window_layer_pattern()  # raises on a malformed --window-size or --window-attn-skip-freq
        if self.quick_geglu and self.bias_activation_fusion and not all(self.moe_layer_pattern()):
            raise UnrunnableFlags(
                "--quick-geglu with biases in a dense MLP: megatron-core fuses a dense MLP's bias and activation for "
                "GELU and SwiGLU only (transformer/mlp.py raises \"Only support fusion of gelu and swiglu\"); add "
                "--disable-bias-linear or --no-bias-gelu-fusion")
        if self.num_experts is not None:
            self._check_moe()
        else:
            layer_pattern(self.moe_layer_freq, self.num_layers)   # Megatron parses it with or without experts
        self._check_expert_rank_budget()     # Megatron's rules hold with or without experts
        if self.fp8 is not None:
            self._check_fp8()
        elif self.fp8_param_gather:
            raise PipetteError("--fp8-param-gather needs --fp8-format (the weights it gathers are FP8)")
        if self.fp4 is not None:
            self._check_fp4()
        elif self.fp4_param_gather:
            raise PipetteError("--fp4-param-gather needs --fp4-format (the weights it gathers are FP4)")
        if self.reuse_grad_buf_for_mxfp8_param_ag and not (self.fp8_param_gather and self.fp8_recipe == "mxfp8"):
            raise PipetteError("--reuse-grad-buf-for-mxfp8-param-ag needs --fp8-param-gather and --fp8-recipe mxfp8 "
                               "(megatron-core asserts the first; the model prices it with MXFP8 weights only)")
        self._check_optimizer()
        self._check_cuda_graphs()

    def _check_fp8(self) -> None:
        if self.fp8 not in FP8_FORMATS:
            raise PipetteError(f"--fp8-format must be one of {', '.join(FP8_FORMATS)}, got {self.fp8!r}")
        if self.precision not in ("bf16", "fp16"):
            raise PipetteError(f"--fp8-format {self.fp8} needs --bf16 or --fp16 (FP8 GEMMs keep 16-bit weights)")
        if self.fp8_recipe == "mxfp8" and self.fp8_param_gather and not self.reuse_grad_buf_for_mxfp8_param_ag:
            raise PipetteError("--fp8-param-gather with --fp8-recipe mxfp8 is priced with "
                               "--reuse-grad-buf-for-mxfp8-param-ag only (as NVIDIA's recipes run it; without it "
                               "megatron-core maps MXFP8 weights onto a 16-bit parameter buffer the model does not "
                               "describe)")

    def _check_fp4(self) -> None:
        if self.fp4 not in FP4_FORMATS:
            raise PipetteError(f"--fp4-format must be one of {', '.join(FP4_FORMATS)}, got {self.fp4!r}")
        if self.fp8 is not None:
            raise PipetteError(f"--fp4-format {self.fp4} and --fp8-format {self.fp8} exclude each other "
                               "(as in Megatron)")
        if self.precision != "bf16":
            raise PipetteError(f"--fp4-format {self.fp4} needs --bf16 (Transformer Engine's NVFP4 Hadamard "
                               "transform takes bf16 inputs)")

    def _check_optimizer(self) -> None:
        dtypes = {"main_params_dtype": get_args(MainParamsDtype), "main_grads_dtype": get_args(MainGradsDtype),
                  "exp_avg_dtype": get_args(OptimizerStateDtype), "exp_avg_sq_dtype": get_args(OptimizerStateDtype)}
        for field, allowed in dtypes.items():
            value = getattr(self, field)
            if value not in allowed:
                raise PipetteError(f"{megatron_flag(field)} must be one of {', '.join(allowed)}, got {value!r}")
            if value != "fp32" and not self.use_precision_aware_optimizer:
                raise PipetteError(f"{megatron_flag(field)} {value} needs --use-precision-aware-optimizer "
                                   "(as in Megatron)")

    def _check_moe(self) -> None:
        for field in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            if getattr(self, field) is not None:
                check_count(field, getattr(self, field))
        if self.moe_router_topk > self.num_experts:
            raise PipetteError(f"--moe-router-topk {self.moe_router_topk} exceeds --num-experts {self.num_experts}")
        factor = self.moe_expert_capacity_factor
        if factor is not None and not in_range(factor, 0, MAX_SIZE, above=True):
            raise PipetteError(f"--moe-expert-capacity-factor must be a positive number up to {MAX_SIZE}, "
                               f"got {factor!r}")
        if self.moe_pad_expert_input_to_capacity and factor is None:
            raise PipetteError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if self.moe_enable_deepep and (self.moe_token_dispatcher_type != "flex"
                                       or self.moe_flex_dispatcher_backend != "deepep"):
            raise PipetteError("--moe-enable-deepep needs --moe-token-dispatcher-type flex and no other "
                               "--moe-flex-dispatcher-backend (as in Megatron; it is the deprecated spelling of "
                               "--moe-flex-dispatcher-backend deepep)")
        if self.moe_token_dispatcher_type == "flex" and self.moe_pad_expert_input_to_capacity \
                and self.moe_flex_dispatcher_backend == "deepep":
            raise PipetteError("--moe-pad-expert-input-to-capacity does not run with the flex dispatcher's deepep "
                               "backend (as in Megatron)")
        groups, chosen = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (chosen is None):
            raise PipetteError("--moe-router-num-groups and --moe-router-group-topk go together")
        if groups is not None:      # both positive integers (__post_init__'s check_count)
            if chosen > groups:
                raise PipetteError(f"--moe-router-group-topk {chosen} must be in 1..--moe-router-num-groups {groups}")
            if self.num_experts % groups or self.moe_router_topk % chosen:
                raise PipetteError(f"--moe-router-num-groups {groups} must divide --num-experts {self.num_experts} "
                                   f"and --moe-router-group-topk {chosen} --moe-router-topk {self.moe_router_topk}")
        if self.moe_shared_expert_intermediate_size is not None and self.add_bias_linear:
            raise PipetteError("--moe-shared-expert-intermediate-size needs --disable-bias-linear "
                               "(megatron-core's shared experts have no biases)")
        self._check_expert_activation()
        self.moe_layer_pattern()  # raises on a malformed --moe-layer-freq

    def _check_expert_rank_budget(self) -> None:
        """--moe-expert-rank-capacity-factor and --moe-paged-stash as megatron-core 0.19.2's
        TransformerConfig.__post_init__ rules them (the ncclep backend is not modelled)."""
        factor = self.moe_expert_rank_capacity_factor
        if factor is not None:
            if not in_range(factor, 0, MAX_SIZE, above=True):
                raise PipetteError(f"--moe-expert-rank-capacity-factor must be a positive number up to {MAX_SIZE}, "
                                   f"got {factor!r}")
            if self.moe_token_dispatcher_type != "flex" or self.moe_flex_dispatcher_backend != "hybridep":
                raise PipetteError(f"--moe-expert-rank-capacity-factor {factor} needs --moe-token-dispatcher-type flex "
                                   "with --moe-flex-dispatcher-backend hybridep (megatron-core asserts the backend; "
                                   "the budget is HybridEP's)")
            if not self.use_transformer_engine_op_fuser:
                raise PipetteError(f"--moe-expert-rank-capacity-factor {factor} with HybridEP needs "
                                   "--use-transformer-engine-op-fuser (megatron-core 0.19.2's TransformerConfig "
                                   "asserts it)")
        for field in ("moe_paged_stash_buffer_size_factor_cuda", "moe_paged_stash_buffer_size_factor_cpu"):
            if not in_range(getattr(self, field), -MAX_SIZE, MAX_SIZE):
                raise PipetteError(f"{megatron_flag(field)} must be a number, got {shown(getattr(self, field))}")
        if self.moe_paged_stash and factor is None:
            raise PipetteError("--moe-paged-stash needs --moe-expert-rank-capacity-factor (megatron-core 0.19.2's "
                               "TransformerConfig asserts it)")

    def _check_cuda_graphs(self) -> None:
        """--cuda-graph-impl and --cuda-graph-modules as megatron-core 0.19.2 reads them
        (training/arguments.py _normalize_cuda_graph_modules_args, transformer_config.py
        __post_init__): the deprecated spellings migrated, then its assertions."""
        modules = list(self.cuda_graph_modules)
        if isinstance(self.cuda_graph_modules, str):     # one word, as a preset or plan document may give it
            modules = self.cuda_graph_modules.split(",") if self.cuda_graph_modules else []
        impl = self.cuda_graph_impl
        if modules == ["full"]:
            modules = []
        elif "full" in modules:
            raise PipetteError("--cuda-graph-modules full cannot be given with other modules (Megatron asserts)")
        if "full_iteration" in modules:
            impl = "full_iteration"       # Megatron migrates the deprecated module to the implementation
        modules = [m for m in modules if m not in ("full_iteration", "full_iteration_inference")]
        if impl not in CUDA_GRAPH_IMPLS:
            raise PipetteError(f"--cuda-graph-impl must be one of {', '.join(CUDA_GRAPH_IMPLS)}, got {impl!r}")
        unknown = [m for m in modules if m not in CUDA_GRAPH_MODULES]
        if unknown:
            raise PipetteError(f"--cuda-graph-modules {' '.join(map(str, unknown))}: the cost model prices "
                               f"{', '.join(CUDA_GRAPH_MODULES)} (mamba needs Mamba layers)")
        if impl == "none":     # Megatron checks the modules only where graphs are built
            object.__setattr__(self, "cuda_graph_modules", tuple(modules))
            return
        if impl == "local" and {"moe_router", "moe_preprocess"} & set(modules):
            modules += [m for m in ("moe_router", "moe_preprocess") if m not in modules]  # as Megatron does
        rules = (
            (impl == "full_iteration" and bool(modules), "--cuda-graph-modules must be empty with --cuda-graph-impl "
                                                         "full_iteration"),
            ("moe" in modules and "moe_router" in modules, "--cuda-graph-modules takes moe or moe_router, not both"),
            ("moe_preprocess" in modules and "moe_router" not in modules,
             "--cuda-graph-modules moe_preprocess needs moe_router"),
            (self.num_experts is None and bool({"moe", "moe_router"} & set(modules)),
             "--cuda-graph-modules moe and moe_router need --num-experts"),
            (self.num_experts is not None and "mlp" in modules and all(self.moe_layer_pattern()),
             "--cuda-graph-modules mlp needs dense layers (every layer is MoE)"),
            (self.num_experts is not None and "moe" in modules
             and not (self.moe_expert_capacity_factor is not None and self.moe_pad_expert_input_to_capacity),
             "--cuda-graph-modules moe needs drop-and-pad experts (--moe-expert-capacity-factor and "
             "--moe-pad-expert-input-to-capacity)"),
            (self.num_experts is not None and "moe_preprocess" in modules
             and self.moe_token_dispatcher_type == "alltoall" and self.moe_expert_capacity_factor is not None
             and not self.moe_pad_expert_input_to_capacity,
             "--cuda-graph-modules moe_preprocess with the alltoall dispatcher and a capacity factor: its "
             "preprocessing copies to the host"),
        )
        for broken, message in rules:
            if broken:
                raise PipetteError(f"{message} (megatron-core 0.19.2's TransformerConfig asserts it)")
        object.__setattr__(self, "cuda_graph_impl", impl)
        object.__setattr__(self, "cuda_graph_modules", tuple(modules))

    def _check_expert_activation(self) -> None:
        """Routed experts scale each token's activation by its router probability, and megatron-core
        0.19 runs that for some activations and biases only (transformer/mlp.py with a per-token
        scale, moe/experts.py): the others plan in full, then raise in the first forward. Megatron's
        own flags cannot run either, so the hook stops (UnrunnableFlags) instead of falling back."""
        flags = f"--num-experts {self.num_experts}" + (" --swiglu" if self.swiglu else "") + \
            (" --quick-geglu" if self.quick_geglu else "")
        if self.add_bias_linear and self.attention_backend == "local":
            raise UnrunnableFlags(
                f"{flags} with biases on Megatron's local layers (no Transformer Engine): a routed expert adds "
                "its output bias in place on a view autograd forbids (\"Output 0 of "
                "_ReduceFromModelParallelRegion is a view and is being modified inplace\"); add --disable-bias-linear")
        if self.bias_activation_fusion and not self.gated_linear_unit:
            raise UnrunnableFlags(
                f"{flags} with GELU experts and biases: megatron-core fuses a routed expert's bias and activation "
                "for SwiGLU and quick-GeGLU only (its first forward raises \"Only support fusion of swiglu and "
                "quick_gelu\"); add --swiglu --disable-bias-linear, --disable-bias-linear, or --no-bias-gelu-fusion")
        if self.bias_activation_fusion and self.add_bias_linear and self.swiglu:   # quick-GeGLU's takes one
            raise UnrunnableFlags(
                f"{flags} with biases: megatron-core's fused SwiGLU of routed experts takes no bias (its first "
                "forward raises \"Bias is not supported for weighted swiglu fusion\"); add --disable-bias-linear "
                "or --no-bias-swiglu-fusion")

    # Derived values, by Megatron's rules (megatron/training/arguments.py).
    @property
    def bias_activation_fusion(self) -> bool:
        """TransformerConfig.bias_activation_fusion as Megatron-LM sets it: --bias-swiglu-fusion with
        --swiglu, else --bias-gelu-fusion, which validate_args turns off without biases
        (training/arguments.py, training/argument_utils.py)."""
        return self.bias_swiglu_fusion if self.swiglu else self.bias_gelu_fusion and self.add_bias_linear

    @property
    def rope_concentration_factor(self) -> float:
        """What scales the cosines and sines of RoPE: YaRN's concentration factor (megatron-core
        0.19's _yarn_get_concentration_factor, with the values training/argument_utils.py gives a
        non-MLA model from --rotary-scaling-factor, --mscale and --mscale-all-dim), 1 otherwise."""
        if self.position_embedding_type != "yarn" or self.multi_latent_attention:
            return 1.0
        scale = self.rotary_scaling_factor
        return _yarn_mscale(scale, self.mscale) / _yarn_mscale(scale, self.mscale_all_dim)

    @property
    def gated_linear_unit(self) -> bool:
        """TransformerConfig.gated_linear_unit: fc1 doubled into a gate and a value (--swiglu, --quick-geglu)."""
        return self.swiglu or self.quick_geglu

    @property
    def fc1_widening(self) -> int:
        """fc1's output over the MLP's width: 2 for a gated MLP (the gate and the value side by
        side), else 1."""
        return 2 if self.gated_linear_unit else 1

    @property
    def cross_entropy_fusion(self) -> str | None:
        """The fused cross entropy language_module.compute_language_model_loss runs (native, te);
        None: the plain vocab_parallel_cross_entropy."""
        return self.cross_entropy_fusion_impl if self.cross_entropy_loss_fusion else None

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_head_dim(self) -> int:
        """A query (and key) head's width: MLA's qk_head_dim plus its rotary part."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def query_groups(self) -> int:
        """Key/value heads (MLA: one per query head)."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def bytes_per_element(self) -> int:
        return BYTES_PER_ELEMENT[self.precision]

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes per parameter of the optimizer's state: the master weights and Adam's two moments.
        The precision-aware optimizer hands the master weights to Transformer Engine's FusedAdam
        unless FP8 tensorwise weights need megatron-core's own fp32 copy (optimizer_config.py,
        use_precision_aware_optimizer_no_fp8_or_ds_fp8); FusedAdam then keeps only the 16 bits an
        fp32 master adds to a bf16 weight (store_param_remainders)."""
        moments = OPTIMIZER_DTYPES[self.exp_avg_dtype] + OPTIMIZER_DTYPES[self.exp_avg_sq_dtype]
        if self.precision == "fp32":
            return moments
        master = OPTIMIZER_DTYPES[self.main_params_dtype]
        if self.te_holds_master_weights and self.main_params_dtype == "fp32" and self.precision == "bf16":
            master = 2
        return master + moments

    @property
    def quantisation_recipe(self) -> str | None:
        """The recipe Transformer Engine quantises the layers' linears with (--fp8-recipe under
        --fp8-format, --fp4-recipe under --fp4-format), None where they run in the training dtype."""
        if self.fp4 is not None:
            return self.fp4_recipe
        return self.fp8_recipe if self.fp8 is not None else None

    @property
    def param_gather_bytes(self) -> float | None:
        """Bytes a parameter of the layers' linears moves in the distributed optimizer's all-gather
        where they are kept quantised: 1 under --fp8-param-gather, 0.5 + 1/16 under
        --fp4-param-gather (packed E2M1 and its E4M3 scales; param_and_grad_buffer.py gathers the
        packed rowwise bytes, nvfp4_packed_numel); None: the training dtype's. Under MXFP8 the
        optimizer gathers 16-bit weights into the gradient buffer and quantises them after
        (param_and_grad_buffer.py: the MXFP8 shared_buffer's param_data is a bf16 view;
        distrib_optimizer.py _copy_main_params_to_param_buffer)."""
        if self.fp4_param_gather:
            return quantised_bytes(self.fp4_recipe)
        return 1 if self.fp8_param_gather and self.fp8_recipe != "mxfp8" else None

    @property
    def keeps_quantised_weights(self) -> bool:
        """The layers' linear weights are kept only quantised (--fp8-param-gather, --fp4-param-gather)."""
        return self.fp8_param_gather or self.fp4_param_gather

    @property
    def te_holds_master_weights(self) -> bool:
        """Transformer Engine's FusedAdam keeps the master weights and reads the gradients in place."""
        return self.use_precision_aware_optimizer and (
            self.main_params_dtype != "fp32" or self.fp8 is None or self.fp8_recipe == "delayed")

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of Megatron's gradient buffer (each parameter's main_grad, which the
        weight-gradient GEMMs accumulate into and data parallelism reduces): fp32 under --bf16
        (grad_reduce_in_fp32) unless --grad-reduce-in-bf16, else the parameters' dtype."""
        if self.precision == "bf16":
            return 2 if self.grad_reduce_in_bf16 else 4
        return 4 if self.precision == "fp32" else 2

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Megatron pads the vocabulary to a multiple of divisible_by * TP."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    @property
    def moe_ffn(self) -> int:
        """One routed expert's FFN width (Megatron: --moe-ffn-hidden-size, else --ffn-hidden-size)."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn

    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """Which layers are MoE (megatron/core/models/gpt/gpt_layer_specs.py get_moe_layer_pattern)."""
        return self._moe_layer_pattern

    # Derived once per workload (the search reads them for every layout it prices); a frozen
    # dataclass keeps them in its __dict__, outside its fields, equality and hash.
    @cached_property
    def _moe_layer_pattern(self) -> tuple[bool, ...]:
        if self.num_experts is None:
            return (False,) * self.num_layers
        return layer_pattern(self.moe_layer_freq, self.num_layers)

    @cached_property
    def window(self) -> int | None:
        """Earlier keys a windowed layer's query attends to (--window-size's left side, read as
        Megatron's tuple_type reads it); None: no window (unset, or -1, unbounded). The right side
        is masked by the causal mask whatever its value."""
        if self.window_size is None:
            return None
        try:
            sides = tuple(int(x) for x in str(self.window_size).strip("()").split(","))
        except ValueError:
            sides = ()
        if len(sides) != 2 or min(sides) < -1 or max(sides) > MAX_SIZES["seq_length"]:
            raise PipetteError(f"--window-size must be two integers \"left,right\", each -1 (unbounded) or "
                               f"0..{MAX_SIZES['seq_length']}, such as \"127,0\"; got {shown(self.window_size)}")
        return None if sides[0] == -1 else sides[0]

    def window_layer_pattern(self) -> tuple[bool, ...]:
        """Which layers attend through the window (megatron/core/transformer/utils.py
        is_layer_window_attention: layer numbers count from 1; an integer N keeps every N-th full)."""
        return self._window_layer_pattern

    @cached_property
    def _window_layer_pattern(self) -> tuple[bool, ...]:
        n = self.num_layers
        if self.window_attn_skip_freq is None:
            windowed = (True,) * n
        else:
            every = frequency_or_list(self.window_attn_skip_freq, n, "--window-attn-skip-freq",
                                      f"[1,0]*{max(n // 2, 1)}")
            windowed = tuple((i + 1) % every != 0 if isinstance(every, int) else bool(every[i]) for i in range(n))
        return windowed if self.window is not None else (False,) * n

    def attention_linears(self) -> dict[str, tuple[int, int, str]]:
        """(out, in, how Transformer Engine splits it over TP) of one layer's attention linears,
        unsharded: "column" splits the output, "row" the input, "duplicated" none (MLA's down
        projections, megatron/core/transformer/multi_latent_attention.py; the local spec splits
        them as column-parallel, whose per-rank share this model does not follow)."""
        return dict(self._attention_linears)

    @cached_property
    def _attention_linears(self) -> tuple[tuple[str, tuple[int, int, str]], ...]:
        h, a, dq, dv = self.hidden_size, self.num_attention_heads, self.query_head_dim, self.value_head_dim
        if not self.multi_latent_attention:
            return (("qkv", ((a + 2 * self.query_groups) * dq, h, "column")), ("proj", (h, a * dv, "row")))
        query = ((("q_proj", (a * dq, h, "column")),) if self.q_lora_rank is None else
                 (("q_down", (self.q_lora_rank, h, "duplicated")), ("q_up", (a * dq, self.q_lora_rank, "column"))))
        return (*query, ("kv_down", (self.kv_lora_rank + self.qk_pos_emb_head_dim, h, "duplicated")),
                ("kv_up", (a * (self.qk_head_dim + dv), self.kv_lora_rank, "column")), ("proj", (h, a * dv, "row")))

    def qk_norm_widths(self) -> tuple[int, ...]:
        """Widths of --qk-layernorm's norms, each with its own weights: a head's query and key (one
        norm shared by the heads), or MLA's query and key/value latents."""
        if not self.qk_layernorm:
            return ()
        if not self.multi_latent_attention:
            return (self.head_dim, self.head_dim)
        return (self.kv_lora_rank,) if self.q_lora_rank is None else (self.q_lora_rank, self.kv_lora_rank)

    # Parameter counts, per full (unsharded) model.
    def attention_parameters(self) -> int:
        """The attention linears of one layer (biases on the QKV and output projections only:
        MLA's are bias-free but the output's), its query/key norms and --softmax-type learnable's
        offsets (one per head)."""
        return self._attention_parameters

    @cached_property
    def _attention_parameters(self) -> int:
        bias = self.add_bias_linear
        weights = sum(out * inp for out, inp, _ in self.attention_linears().values())
        biases = sum(out for name, (out, _, _) in self.attention_linears().items() if name in ("qkv", "proj"))
        sinks = self.num_attention_heads if self.softmax_type == "learnable" else 0   # split over TP with the heads
        return weights + (biases if bias else 0) + sum(map(self._norm_parameters, self.qk_norm_widths())) + sinks

    def attention_replicated_parameters(self) -> int:
        """Of one layer's attention parameters, those every TP rank holds whole: the output
        projection's bias, the query/key norms and MLA's duplicated down projections."""
        return self._attention_replicated_parameters

    @cached_property
    def _attention_replicated_parameters(self) -> int:
        duplicated = sum(out * inp for out, inp, split in self.attention_linears().values() if split == "duplicated")
        norms = sum(map(self._norm_parameters, self.qk_norm_widths()))
        return (self.hidden_size if self.add_bias_linear else 0) + norms + duplicated

    def mlp_parameters(self, ffn: int) -> int:
        """One MLP of FFN width `ffn` (fc1, with SwiGLU's gate, and fc2)."""
        h, bias = self.hidden_size, self.add_bias_linear
        fc1_out = self.fc1_widening * ffn
        return h * fc1_out + (fc1_out if bias else 0) + ffn * h + (h if bias else 0)

    def router_parameters(self) -> int:
        """The router of one MoE layer: an [experts, h] weight (and a bias), replicated everywhere."""
        return self.num_experts * self.hidden_size + (self.num_experts if self.add_bias_linear else 0)

    def shared_expert_parameters(self) -> int:
        shared = self.moe_shared_expert_intermediate_size
        return 0 if shared is None else self.mlp_parameters(shared)

    def layer_parameters(self, moe: bool = False) -> int:
        """Parameters of one transformer layer, dense or MoE (router, every routed expert, shared experts)."""
        mlp = (self.router_parameters() + self.num_experts * self.mlp_parameters(self.moe_ffn)
               + self.shared_expert_parameters()) if moe else self.mlp_parameters(self.ffn)
        return self.attention_parameters() + mlp + 2 * self.norm_parameters()

    def norm_parameters(self) -> int:
        return self._norm_parameters(self.hidden_size)

    @property
    def mtp_layers(self) -> int:
        """--mtp-num-layers, 0 without multi-token prediction."""
        return self.mtp_num_layers or 0

    @property
    def mtp_layer_is_moe(self) -> bool:
        """An MTP layer has the last decoder layer's spec (gpt_layer_specs.get_gpt_mtp_block_spec)."""
        return self.moe_layer_pattern()[-1]

    def mtp_norm_parameters(self) -> int:
        """One MTP layer's norms: the embedding's, the hidden state's and the final one."""
        return 3 * self.norm_parameters()

    def mtp_extra_parameters(self) -> int:
        """One MTP layer's parameters beyond its transformer layer: its norms and the 2h-to-h
        projection (no bias); it shares the word embedding and the output layer."""
        return self.mtp_norm_parameters() + 2 * self.hidden_size * self.hidden_size

    def _norm_parameters(self, width: int) -> int:
        return 2 * width if self.normalization == "LayerNorm" else width

    def embedding_parameters(self, tensor_model_parallel_size: int = 1) -> int:
        """Word (padded) plus learned position embeddings, unsharded."""
        words = self.padded_vocab_size(tensor_model_parallel_size) * self.hidden_size
        positions = self.max_positions * self.hidden_size if self.position_embedding_type == "learned_absolute" else 0
        return words + positions

    def total_parameters(self, tensor_model_parallel_size: int = 1) -> int:
        """All parameters; a tied output layer shares the word embedding."""
        output = (self.padded_vocab_size(tensor_model_parallel_size) * self.hidden_size
                  if self.untie_embeddings_and_output_weights else 0)
        layers = sum(self.layer_parameters(moe) for moe in self.moe_layer_pattern())
        mtp = self.mtp_layers * (self.layer_parameters(self.mtp_layer_is_moe) + self.mtp_extra_parameters())
        return layers + mtp + self.embedding_parameters(tensor_model_parallel_size) + self.norm_parameters() + output

    def model_flops_per_iteration(self) -> float:
        """Model FLOPs of one iteration (forward+backward, no recomputation), Megatron's MFU convention
        (megatron/training/training.py, num_floating_point_operations): an MoE layer counts its top-k
        routed experts and its shared experts, not the router; the core attention counts the causal
        half of the scores only, whatever the backend computes; an MTP layer counts as a layer of the
        last one's kind, its norms and projection as 3h + 2h^2 multiply-adds a token, its logits."""
        tokens = self.global_batch_size * self.seq_length
        h, s, a = self.hidden_size, self.seq_length, self.num_attention_heads
        stacked = 3 if self.swiglu else 2
        projections = sum(out * inp for out, inp, _ in self.attention_linears().values())
        if self.multi_latent_attention:  # Megatron counts one multiply-add per latent element for the norms
            projections += self.kv_lora_rank + (0 if self.q_lora_rank is None else self.q_lora_rank)
        # QK^T and AV per token, multiply-adds, over the causal half (s/2 keys)
        attention = s * a * (self.query_head_dim + self.value_head_dim) / 2
        mtp = self.mtp_layers
        layers = self.num_layers + mtp
        moe_layers = sum(self.moe_layer_pattern()) + (mtp if self.mtp_layer_is_moe else 0)
        shared = self.moe_shared_expert_intermediate_size or 0
        mlp = stacked * h * (self.ffn * (layers - moe_layers)
                             + (self.moe_ffn * self.moe_router_topk + shared) * moe_layers)
        per_token = layers * (2 * projections + 2 * attention) + 2 * mlp + 2 * mtp * (3 * h + 2 * h * h)
        logits = 2 * h * self.padded_vocab_size(1) * (1 + mtp)
        return 3.0 * tokens * (per_token + logits)


def layer_pattern(freq: int | str, num_layers: int) -> tuple[bool, ...]:
    """Which layers --moe-layer-freq makes MoE: every freq-th (layer 0 always), or Megatron's list form
    (megatron/core/models/gpt/gpt_layer_specs.py get_moe_layer_pattern)."""
    every = frequency_or_list(freq, num_layers, "--moe-layer-freq", f"([0]+[1]*{num_layers - 1})")
    if isinstance(every, int):
        return tuple(i % every == 0 for i in range(num_layers))
    return tuple(bool(x) for x in every)


def frequency_or_list(freq: int | str, num_layers: int, flag: str, example: str) -> int | list[int]:
    """A per-layer flag as Megatron's moe_freq_type reads it (--moe-layer-freq, --window-attn-skip-freq):
    a positive integer, or a list expression of `num_layers` 0/1 entries."""
    if isinstance(freq, str) and freq.strip().isdigit() and len(freq.strip()) <= len(str(MAX_INTEGER)):
        freq = int(freq)
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return freq
    pattern = list_expression(freq, max_length=num_layers, flag=flag) if isinstance(freq, str) and "[" in freq \
        else None
    if not (isinstance(pattern, list) and len(pattern) == num_layers and set(pattern) <= {0, 1}):
        raise PipetteError(f"{flag} must be a positive integer or a list of {num_layers} 0/1 entries such as "
                           f"\"{example}\", got {shown(freq)}")
    return pattern


def model_presets() -> dict[str, dict]:
    """Named model presets from data/models.json, as Megatron argument dicts."""
    text = resources.files("megatron_pipette.data").joinpath("models.json").read_text()
    return json.loads(text)["models"]


def workload_from_preset(name: str, **overrides) -> Workload:
    """A preset with some fields replaced (None values are ignored)."""
    presets = model_presets()
    if name not in presets:
        raise PipetteError(f"--model {name!r} is not a known preset; choose one of {', '.join(presets)}")
    fields = {**presets[name], "name": name}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return Workload(**fields)


def workload_fields() -> list[dataclasses.Field]:
    """The fields a CLI exposes as Megatron flags."""
    return [f for f in dataclasses.fields(Workload) if f.name != "name"]
