"""The host's floor under a layer's time: the host launches every kernel, so a pass cannot run
faster than the host issues its kernels; CUDA graphs replay captured kernels for one launch.

In eager PyTorch the host runs ahead of the GPU and queues kernels; where the device time of a
pass's kernels is less than the host's time to issue them (Python modules, the dispatcher, the
launch), the GPU waits for the host. Within one pass of a model chunk (a micro-batch's forward,
backward, or recomputed forward) nothing synchronises, so the host's lead carries from layer to
layer and the pass takes max(device seconds, host seconds) summed over its layers
(cost.compute.ChunkWork.seconds). Host seconds = kernels launched x the host's seconds per kernel,
forward and backward apart (the forward's kernels are issued from Megatron's Python modules, the
backward's mostly from autograd's C++ engine: measured apart, below).

Kernels per layer are counted from megatron-core 0.19.2's code as it runs on a GPU (one CUDA
kernel per ATen operation that computes; a torch.compile'd fusion, jit_fuser's bias-GELU,
bias-SwiGLU and bias-dropout-add, one kernel; views none), for the local spec
(get_gpt_layer_local_spec, no Apex: torch norms, unfused attention, unfused RoPE) and Transformer
Engine's (get_gpt_layer_with_transformer_engine_spec: norms fused into the linears that follow,
fused attention and RoPE), by region, since --cuda-graph-modules captures regions: `attn`
(TransformerLayer._forward_attention), and of the MLP half, `mlp` for a dense layer; for an MoE
layer `moe_router` (pre-MLP norm, router, shared experts), `moe_preprocess` (the dispatcher's
preprocessing) and the rest (permutation, dispatch, experts, combine: captured only by `moe`).
Tensor-parallel collectives are priced apart (cost.timing) and not counted here.

Seconds per kernel (measured, H200, benchmarks/results/h200-2026-11-28-layer-chain): one local-spec
layer of the 1.3B GPT (hidden 2048, 16 heads, seq 2048, bf16) at TP 1, micro-batch 1, timed inside
chains of two and four calls: 2.109 ms forward, 1.767 ms backward a call, against 0.70 and 1.40 ms
of device time priced; with 16 forward and 28 backward kernels (LOCAL_GPT_KERNELS) that is 132 us
and 63 us a kernel. The forward there is host-bound (3.0x its device price; the profile's forwards
at TP 2 and 4, micro-batches 1-4, sit at 2.72-3.02 ms whatever their work,
h200-2026-11-26-profiles); the backward is taken as host-bound too (its TP 4 profile, 5.5x the
device price, takes 2.23 ms alone, the start of a lone call included). That host cost is the local
spec's on that host (its Python modules, and jit_fuser's compiled functions, which hit torch.dynamo's
recompile limit there and are looked up on every call): Transformer Engine's layers issue theirs far
faster, as the H100 and Blackwell runs bound (TE_SECONDS_PER_KERNEL, a fit within that bound). Other
hosts (Grace on GB200/GB300) are taken as fast as the hosts of those runs: not measured.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from megatron_pipette.spec.job import Job
from megatron_pipette.spec.workload import Workload


class Kernels(NamedTuple):
    """Kernels one pass of a region launches: forward, backward, and recomputed forward."""

    forward: int = 0
    backward: int = 0
    recompute: int = 0

    def __add__(self, other: Kernels) -> Kernels:
        return Kernels(*(a + b for a, b in zip(self, other, strict=True)))


LOCAL_GPT_KERNELS = Kernels(16, 28)
"""The local-spec layer the seconds per kernel were measured on (the 1.3B GPT: LayerNorm, biases,
learned positions, GELU, dropout), as layer_kernels counts it (a test holds them equal)."""
LOCAL_SECONDS_PER_KERNEL = (2.109e-3 / LOCAL_GPT_KERNELS.forward, 1.767e-3 / LOCAL_GPT_KERNELS.backward)
"""Host seconds per kernel of the local spec's forward and backward passes, 132 and 63 us
(measured: module docstring)."""
TE_SECONDS_PER_KERNEL = (8e-6, 8e-6 * LOCAL_SECONDS_PER_KERNEL[1] / LOCAL_SECONDS_PER_KERNEL[0])
"""Host seconds per kernel of Transformer Engine's layers, forward 8 us and backward 3.8 us (the local
spec's ratio): a fit to the development sets within their bound, not a measurement. At the local
spec's cost the H100 set's Qwen3-30B rows would be priced 72-170% too slow; no row of either set
moves at 8 us, at 16 us one Blackwell row does (the B200 Qwen3-30B 25.09 token-drop run, +30% ->
+41%), at 33 us the H100 Qwen3-30B rows do (+8.9% -> +23.6%). Lower bound: CUDA's kernel launch,
a few microseconds (not measured here). docs/time-model.md, "Launch floor"."""


def seconds_per_kernel(w: Workload) -> tuple[float, float]:
    """(forward, backward) host seconds per kernel of the workload's layers: the local spec's
    (attention_backend local: what Megatron builds without Transformer Engine) or Transformer Engine's."""
    return LOCAL_SECONDS_PER_KERNEL if w.attention_backend == "local" else TE_SECONDS_PER_KERNEL


class HostFloor(NamedTuple):
    """Host seconds of one layer's passes on one rank, per micro-batch."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0


def _linear(w: Workload, bias_added: bool = False) -> Kernels:
    """A linear: its GEMM, forward; data- and weight-gradient GEMMs, backward; a bias the local
    spec adds after the GEMM (column-parallel QKV; skip_bias_add elsewhere), and its gradient's sum;
    under FP8/FP4 Transformer Engine quantises the input forward and the gradient backward."""
    quantised = int(w.quantisation_recipe is not None)
    bias = int(bias_added and w.add_bias_linear)
    return Kernels(1 + bias + quantised, 2 + bias + quantised)


def _norm() -> Kernels:
    """A LayerNorm or RMSNorm (torch's, or fused into Transformer Engine's linear): one kernel
    forward, the input's and the weights' gradients backward."""
    return Kernels(1, 2)


def _core_attention(w: Workload) -> Kernels:
    """The attention core. Local (DotProductAttention, masked_softmax_fusion off as without Apex
    kernels): baddbmm, mask, softmax, dropout, bmm, the context's copy to [s, b, h]; backward two
    GEMMs each for the batched products, and the mask, softmax and dropout gradients. Transformer
    Engine's flash or cuDNN kernel: one forward, two backward (the main kernel and its dQ pass)."""
    if w.attention_backend in ("local", "unfused"):
        dropout = int(w.attention_dropout > 0)
        return Kernels(5 + dropout, 6 + dropout)
    return Kernels(1, 2)


def _bias_dropout_add(w: Workload) -> Kernels:
    """jit_fuser's bias-dropout-add (one compiled kernel); backward the dropout mask's product, the
    residual gradient's sum, and the bias gradient's."""
    return Kernels(1, 2 + int(w.add_bias_linear))


def _activation(w: Workload) -> Kernels:
    """The fused bias-activation (GELU, SwiGLU, quick-GeGLU; one compiled kernel each way) and the
    bias gradient's sum."""
    return Kernels(1, 1 + int(w.add_bias_linear))


def _rope(w: Workload) -> Kernels:
    """RoPE on the query and key: fused (Transformer Engine, one kernel each way a tensor) or the
    local spec's unfused apply_rotary_pos_emb (cos and sin products, rotate_half's slices, negation
    and concatenation: 9 kernels a tensor forward, 5 backward)."""
    if w.position_embedding_type not in ("rope", "yarn"):
        return Kernels()
    return Kernels(18, 10) if w.attention_backend == "local" else Kernels(2, 2)


def attention_kernels(w: Workload) -> Kernels:
    """TransformerLayer._forward_attention: input norm, the attention's linears (QKV, or MLA's),
    --qk-layernorm's norms, RoPE, the core, and the fused bias-dropout-add (and its bias sum)."""
    linears = Kernels()
    for name in w.attention_linears():
        linears = linears + _linear(w, bias_added=name in ("qkv", "q_proj"))
    norms = _norm()
    for _ in w.qk_norm_widths():
        norms = norms + _norm()
    return norms + linears + _rope(w) + _core_attention(w) + _bias_dropout_add(w)


def dense_mlp_kernels(w: Workload) -> Kernels:
    """TransformerLayer._forward_mlp of a dense layer: pre-MLP norm, fc1, the fused bias-activation,
    fc2, the fused bias-dropout-add."""
    return _norm() + _linear(w) + _activation(w) + _linear(w) + _bias_dropout_add(w)


def router_kernels(w: Workload) -> Kernels:
    """moe_router: pre-MLP norm, the router's GEMM, its fp32 cast, score function and top-k,
    the load-balancing loss (megatron-core's TopKRouter: about five each way), group-limited
    routing's group scores; and the shared experts, a dense MLP without its norm."""
    groups = Kernels(3, 2) if w.moe_router_num_groups else Kernels()
    shared = (_linear(w) + _activation(w) + _linear(w)) if w.moe_shared_expert_intermediate_size else Kernels()
    return _norm() + Kernels(1, 2) + Kernels(5, 4) + groups + shared


def preprocess_kernels() -> Kernels:
    """moe_preprocess: the dispatcher's tokens-per-expert count and split sizes (about four kernels;
    the alltoall dispatcher's copy of them to the host is not captured)."""
    return Kernels(4, 0)


def experts_kernels(w: Workload, local_experts: int) -> Kernels:
    """The rest of an MoE layer's MLP: permute and unpermute (two each way), the dispatch and
    combine, each routed expert's fc1 and fc2 GEMMs (Transformer Engine's GroupedLinear and the
    local SequentialMLP launch one per local expert), the activation weighted by the router's
    probabilities, and the fused bias-dropout-add."""
    per_expert = _linear(w) + _linear(w)
    experts = Kernels(*(local_experts * k for k in per_expert))
    return Kernels(4, 4) + Kernels(2, 2) + experts + _activation(w) + _bias_dropout_add(w)


def layer_kernels(job: Job, *, moe: bool) -> dict[str, Kernels]:
    """One layer's kernels by capture region (a dense layer: attn, mlp; an MoE layer: attn,
    moe_router, moe_preprocess, moe_experts), each with what recomputation redoes of it."""
    return _layer_kernels(job.workload, *_layer_settings(job), moe)


def _layer_settings(job: Job) -> tuple[int, str | None, frozenset[str]]:
    """What layer_kernels reads of the layout: EP, --recompute-granularity and what it redoes."""
    layout = job.layout
    return layout.ep, layout.recompute_granularity, layout.selective_modules


def _layer_kernels(w: Workload, ep: int, granularity: str | None, redone: frozenset[str],
                   moe: bool) -> dict[str, Kernels]:
    regions = {"attn": attention_kernels(w)}
    if moe:
        regions.update(moe_router=router_kernels(w), moe_preprocess=preprocess_kernels(),
                       moe_experts=experts_kernels(w, (w.num_experts or 1) // ep))
    else:
        regions["mlp"] = dense_mlp_kernels(w)
    if granularity == "full":
        return {name: k._replace(recompute=k.forward) for name, k in regions.items()}
    up = sum(_linear(w).forward for name in w.attention_linears() if name in ("q_up", "kv_up"))
    again = {"attn": (_core_attention(w).forward if "core_attn" in redone else 0)
             + (up + _rope(w).forward if "mla_up_proj" in redone else 0),
             "mlp": 2 * _linear(w).forward + _activation(w).forward if "mlp" in redone else 0,
             "moe_router": (_norm().forward if "layernorm" in redone else 0),
             "moe_experts": 1 if "moe_act" in redone else 0}
    if "moe" in redone and moe:
        again.update(moe_router=router_kernels(w).forward - _norm().forward,
                     moe_preprocess=preprocess_kernels().forward,
                     moe_experts=experts_kernels(w, (w.num_experts or 1) // ep).forward - 1)
    return {name: k._replace(recompute=again.get(name, 0)) for name, k in regions.items()}


def captured(w: Workload) -> frozenset[str]:
    """The regions of every layer that CUDA graphs capture: all under full_iteration or per-layer
    graphs of the whole layer (empty --cuda-graph-modules), else those the modules name (`moe`: the
    whole MoE MLP half)."""
    if w.cuda_graph_impl == "none":
        return frozenset()
    everything = frozenset({"attn", "mlp", "moe_router", "moe_preprocess", "moe_experts"})
    if w.cuda_graph_impl == "full_iteration" or not w.cuda_graph_modules:
        return everything
    modules = set(w.cuda_graph_modules)
    if "moe" in modules:
        modules |= {"moe_router", "moe_preprocess", "moe_experts"}
    return frozenset(modules & everything)


def moe_layer_graphed(w: Workload) -> bool:
    """Whether CUDA graphs capture an MoE layer's whole MLP half (router, preprocessing, dispatch,
    experts, combine). Megatron captures it only where the dispatch needs no host synchronisation: a
    full_iteration graph cannot hold one, and the `moe` module requires drop-and-pad
    (transformer_config.py); HybridEP with --moe-expert-rank-capacity-factor sizes its buffers
    without one (fused_a2a.py: num_permuted_tokens given, non_blocking). So neither the host's wait
    for the token counts nor the layer's many launches remain (Execution.moe_layer_fixed_s)."""
    return {"moe_router", "moe_preprocess", "moe_experts"} <= captured(w)


def _graph_launches(w: Workload, moe: bool) -> int:
    """Graphs a layer launches a pass: none without per-layer graphs (full_iteration launches one a
    step), one for the whole layer (empty --cuda-graph-modules), else one per module that applies
    to the layer (moe_router and moe_preprocess are captured apart)."""
    if w.cuda_graph_impl in ("none", "full_iteration"):
        return 0
    if not w.cuda_graph_modules:
        return 1
    applies = {"attn"} | ({"moe", "moe_router", "moe_preprocess"} if moe else {"mlp"})
    return len(applies & set(w.cuda_graph_modules))


def layer_floor(job: Job, *, moe: bool) -> HostFloor:
    """Host seconds of one layer's forward, backward and recomputed forward: the kernels of the
    regions no graph captures, and one launch per captured region a layer replays (none under
    full_iteration, whose one graph a step is launched once); recomputation inside a captured
    region runs in its backward graph."""
    kernels, replays = _layer_launches(job.workload, *_layer_settings(job), moe)
    forward, backward = seconds_per_kernel(job.workload)
    return HostFloor(forward_s=(kernels.forward + replays) * forward,
                     backward_s=(kernels.backward + replays) * backward, recompute_s=kernels.recompute * forward)


# Module-level memo (cost.model lists them): a function of the workload and the layout settings
# layer_kernels reads, so the stage_work of every layout of a search counts a layer once.
@lru_cache(maxsize=256)
def _layer_launches(w: Workload, ep: int, granularity: str | None, redone: frozenset[str],
                    moe: bool) -> tuple[Kernels, int]:
    """The kernels of a layer's regions no graph captures, and the graphs it replays (layer_floor)."""
    graphed = captured(w)
    kernels = Kernels()
    for name, k in _layer_kernels(w, ep, granularity, redone, moe).items():
        if name not in graphed:
            kernels = kernels + k
    return kernels, _graph_launches(w, moe)


