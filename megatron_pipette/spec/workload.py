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
from dataclasses import dataclass
from importlib import resources

from megatron_pipette.errors import PipetteError

PRECISIONS = ("fp32", "fp16", "bf16")
BYTES_PER_ELEMENT = {"fp32": 4, "fp16": 2, "bf16": 2}
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")


def megatron_flag(field: str) -> str:
    """The Megatron-LM flag of an argument name: hidden_size -> --hidden-size."""
    return "--" + field.replace("_", "-")


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
    swiglu: bool = False
    """--swiglu: gated MLP, three ffn-sized GEMMs instead of two."""
    vocab_size: int = 50257
    """--vocab-size (or the tokenizer's size) before Megatron pads it."""
    make_vocab_size_divisible_by: int = 128
    """--make-vocab-size-divisible-by; Megatron pads to a multiple of this times TP."""
    untie_embeddings_and_output_weights: bool = False
    """--untie-embeddings-and-output-weights: a separate output matrix."""
    position_embedding_type: str = "learned_absolute"
    """--position-embedding-type: learned_absolute adds max_position_embeddings*h parameters."""
    max_position_embeddings: int | None = None
    """--max-position-embeddings; None: seq_length."""
    normalization: str = "LayerNorm"
    """--normalization: LayerNorm (weight+bias) or RMSNorm (weight)."""
    add_bias_linear: bool = True
    """Biases in the linear layers (Megatron default); --disable-bias-linear turns them off."""
    attention_dropout: float = 0.1
    """--attention-dropout: >0 keeps a dropout mask per attention score."""
    hidden_dropout: float = 0.1
    """--hidden-dropout: >0 keeps a dropout mask per hidden activation."""
    attention_backend: str = "auto"
    """--attention-backend: auto/flash/fused keep no s*s score matrices."""
    precision: str = "bf16"
    """--bf16 / --fp16, else fp32: the dtype of parameters and activations."""
    name: str = "custom"
    """A label for reports; not a Megatron flag."""

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                      "global_batch_size", "vocab_size", "make_vocab_size_divisible_by"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise PipetteError(f"{megatron_flag(field)} must be a positive integer, got {value!r}")
        for field in ("ffn_hidden_size", "kv_channels", "num_query_groups", "max_position_embeddings"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise PipetteError(f"{megatron_flag(field)} must be a positive integer, got {value!r}")
        for field, allowed in (("precision", PRECISIONS), ("attention_backend", ATTENTION_BACKENDS),
                               ("normalization", NORMALIZATIONS),
                               ("position_embedding_type", POSITION_EMBEDDINGS)):
            if getattr(self, field) not in allowed:
                raise PipetteError(f"{megatron_flag(field)} must be one of {', '.join(allowed)}, "
                                   f"got {getattr(self, field)!r}")
        for field in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise PipetteError(f"{megatron_flag(field)} must be in [0, 1), got {getattr(self, field)!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise PipetteError(f"--hidden-size {self.hidden_size} is not divisible by "
                               f"--num-attention-heads {self.num_attention_heads}")
        if self.num_query_groups is not None and not self.group_query_attention:
            raise PipetteError("--num-query-groups needs --group-query-attention")
        if self.group_query_attention:
            if self.num_query_groups is None:
                raise PipetteError("--group-query-attention needs --num-query-groups")
            if self.num_attention_heads % self.num_query_groups:
                raise PipetteError(f"--num-attention-heads {self.num_attention_heads} is not divisible "
                                   f"by --num-query-groups {self.num_query_groups}")

    # Derived values, by Megatron's rules (megatron/training/arguments.py).
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
    def query_groups(self) -> int:
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def bytes_per_element(self) -> int:
        return BYTES_PER_ELEMENT[self.precision]

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Megatron pads the vocabulary to a multiple of divisible_by * TP."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    # Parameter counts, per full (unsharded) model.
    def layer_parameters(self) -> int:
        """Parameters of one transformer layer."""
        h, f, d = self.hidden_size, self.ffn, self.head_dim
        q_out = self.num_attention_heads * d
        kv_out = 2 * self.query_groups * d
        bias = self.add_bias_linear
        qkv = h * (q_out + kv_out) + (q_out + kv_out if bias else 0)
        proj = q_out * h + (h if bias else 0)
        fc1_out = 2 * f if self.swiglu else f
        fc1 = h * fc1_out + (fc1_out if bias else 0)
        fc2 = f * h + (h if bias else 0)
        norms = 2 * self.norm_parameters()
        return qkv + proj + fc1 + fc2 + norms

    def norm_parameters(self) -> int:
        return 2 * self.hidden_size if self.normalization == "LayerNorm" else self.hidden_size

    def embedding_parameters(self, tensor_model_parallel_size: int = 1) -> int:
        """Word (padded) plus learned position embeddings, unsharded."""
        words = self.padded_vocab_size(tensor_model_parallel_size) * self.hidden_size
        positions = self.max_positions * self.hidden_size if self.position_embedding_type == "learned_absolute" else 0
        return words + positions

    def total_parameters(self, tensor_model_parallel_size: int = 1) -> int:
        """All parameters; a tied output layer shares the word embedding."""
        output = (self.padded_vocab_size(tensor_model_parallel_size) * self.hidden_size
                  if self.untie_embeddings_and_output_weights else 0)
        return (self.num_layers * self.layer_parameters() + self.embedding_parameters(tensor_model_parallel_size)
                + self.norm_parameters() + output)

    def model_flops_per_iteration(self) -> float:
        """Model FLOPs of one iteration (forward+backward, no recomputation), Megatron's MFU convention
        (megatron/training/training.py, num_floating_point_operations): the core attention counted
        for the causal half of the scores only, whatever the backend computes."""
        tokens = self.global_batch_size * self.seq_length
        h, s, d = self.hidden_size, self.seq_length, self.head_dim
        q_out = self.num_attention_heads * d
        kv_out = 2 * self.query_groups * d
        gemm_params = h * (q_out + kv_out) + q_out * h + (3 if self.swiglu else 2) * h * self.ffn
        attention = s * q_out  # QK^T and AV per token, multiply-adds, over the causal half (s/2 keys)
        per_token_layer = 2 * gemm_params + 2 * attention
        logits = 2 * h * self.padded_vocab_size(1)
        return 3.0 * tokens * (self.num_layers * per_token_layer + logits)


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
