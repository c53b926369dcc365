"""The layout: how one Megatron job is parallelised, in Megatron's argument names.

`Layout` holds the choices (`--tensor-model-parallel-size` ...), each field under the long name of
its flag; its short properties (tp, cp, ep, dp, pp, etp) are the axis names of Megatron's rank
order strings (tp-cp-ep-dp-pp), which spec.ranks, the cost model and the planner use for axes
and groups throughout (no third spelling: not `tensor`, `data`); `validate_layout`
applies the rules Megatron enforces for a given workload and world size, and
raises `Infeasible` naming the flags when Megatron would reject the layout.
`stage_layers` gives the layers of each pipeline stage and `chunk_sizes` those
of each model chunk, uneven first/last stages and the embedding's or loss's
place in the split included.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, get_args

from megatron_pipette.errors import Infeasible, PipetteError
from megatron_pipette.spec.expressions import MAX_TEXT, shown
from megatron_pipette.spec.workload import MAX_SIZE, Workload, check_count, megatron_flag

RecomputeGranularity = Literal["selective", "full"]
RECOMPUTE_GRANULARITIES = (None, *get_args(RecomputeGranularity))
RecomputeMethod = Literal["uniform", "block"]
RECOMPUTE_METHODS = (None, *get_args(RecomputeMethod))
RecomputeModule = Literal["core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts", "mla_up_proj"]
RECOMPUTE_MODULES = get_args(RecomputeModule)
"""--recompute-modules values the cost model prices (Megatron's other one, gdn_norm_out, needs
gated-delta-net attention, which it refuses)."""
LAYOUT_LETTERS = "EtLm"
"""Layer letters of --pipeline-model-parallel-layout (megatron-core's char2layer_type)."""
ABBREVIATIONS = {
    "tp": "--tensor-model-parallel-size", "cp": "--context-parallel-size", "ep": "--expert-model-parallel-size",
    "etp": "--expert-tensor-parallel-size", "pp": "--pipeline-model-parallel-size",
    "dp": "data-parallel size (GPUs / (TP x CP x PP))", "mbs": "--micro-batch-size",
    "lpv": "--num-layers-per-virtual-pipeline-stage", "layout=": "--pipeline-model-parallel-layout",
    "first": "--decoder-first-pipeline-num-layers", "last": "--decoder-last-pipeline-num-layers",
    "+emb": "--account-for-embedding-in-pipeline-split", "+loss": "--account-for-loss-in-pipeline-split",
    "sp": "--sequence-parallel", "+tpo": "--tp-comm-overlap", "epo": "--overlap-moe-expert-parallel-comm",
    "+dw": "--delay-wgrad-compute", "dopt": "--use-distributed-optimizer", "+opg": "--overlap-param-gather",
    "+step": "--overlap-param-gather-with-optimizer-step",
    "fsdp/": "--use-megatron-fsdp (/STRATEGY: --data-parallel-sharding-strategy)",
    "cpuoff": "--cpu-offloading-num-layers",
    "rc=sel": "--recompute-granularity selective (/MODULES: --recompute-modules)",
    "rc=full": "--recompute-granularity full (/METHOD N: --recompute-method, --recompute-num-layers)",
}
"""What each part of Layout.describe's label stands for."""
MAX_LAYOUT_LENGTH = 1 << 16
"""Letters a --pipeline-model-parallel-layout may unroll to: far more than any model's layers and
stages, few enough that a repeat count like t*99999999999 ends in an error, not a full memory."""
DEFAULT_RECOMPUTE_MODULES = frozenset({"core_attn"})
"""What --recompute-granularity selective redoes when --recompute-modules is not given (TransformerConfig)."""
CpCommType = Literal["p2p", "a2a", "allgather"]
CP_COMM_TYPES = get_args(CpCommType)
"""--cp-comm-type values the cost model prices (a2a+p2p needs hierarchical groups it does not describe)."""
ShardingStrategy = Literal["optim", "optim_grads", "optim_grads_params"]
SHARDING_STRATEGIES = get_args(ShardingStrategy)
"""--data-parallel-sharding-strategy values the cost model prices under --use-megatron-fsdp (Megatron's
fourth, no_shard, keeps every state whole: not modelled)."""
TRANSFORMER_ENGINE_ONLY = {
    "delay_wgrad_compute": "megatron/training/arguments.py validate_args asserts --transformer-impl transformer_engine",
}
"""Layout switches Megatron accepts only with Transformer Engine's layers, and where it says so."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One parallel layout. Hashable, so the search can cache on it."""

    tensor_model_parallel_size: int = 1
    """--tensor-model-parallel-size."""
    pipeline_model_parallel_size: int = 1
    """--pipeline-model-parallel-size."""
    data_parallel_size: int = 1
    """Derived by Megatron as world / (TP * PP); explicit here."""
    micro_batch_size: int = 1
    """--micro-batch-size."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """--num-layers-per-virtual-pipeline-stage: enables the interleaved schedule."""
    sequence_parallel: bool = False
    """--sequence-parallel: shards norm/dropout activations over TP (needs TP > 1)."""
    tp_comm_overlap: bool = False
    """--tp-comm-overlap: Transformer Engine's userbuffers pipeline the TP all-gathers and
    reduce-scatters with the GEMMs beside them (needs --sequence-parallel, and Transformer Engine)."""
    use_distributed_optimizer: bool = False
    """--use-distributed-optimizer: optimizer state sharded over DP (ZeRO-1)."""
    recompute_granularity: RecomputeGranularity | None = None
    """--recompute-granularity: None, "selective" (attention core) or "full"."""
    recompute_method: RecomputeMethod | None = None
    """--recompute-method (full only): "uniform" or "block"."""
    recompute_num_layers: int | None = None
    """--recompute-num-layers (full only): layers per recompute group (uniform) or
    recomputed layers per stage (block)."""
    recompute_modules: tuple[RecomputeModule, ...] | None = None
    """--recompute-modules: the parts of each layer that selective recomputation redoes in its
    backward, of core_attn mlp layernorm moe moe_act shared_experts mla_up_proj; not given: Megatron's default,
    core_attn."""
    decoder_first_pipeline_num_layers: int | None = None
    """--decoder-first-pipeline-num-layers: layers on the first stage, when uneven."""
    decoder_last_pipeline_num_layers: int | None = None
    """--decoder-last-pipeline-num-layers: layers on the last stage, when uneven."""
    pipeline_model_parallel_layout: str | None = None
    """--pipeline-model-parallel-layout: every stage's layers spelt out, E the embedding, t a
    transformer layer, L the loss, | between stages (virtual stages after the first PP), ( )*n and
    x*n repeats, e.g. "Et*3|(t*4|)*2t*3L"; sets the virtual pipeline size."""
    account_for_embedding_in_pipeline_split: bool = False
    """--account-for-embedding-in-pipeline-split: the embedding counts as a layer when splitting,
    so the first stage holds one transformer layer fewer."""
    account_for_loss_in_pipeline_split: bool = False
    """--account-for-loss-in-pipeline-split: the output layer and loss count as a layer, so the
    last stage holds one transformer layer fewer."""
    overlap_grad_reduce: bool = False
    """--overlap-grad-reduce: DP gradient reduction overlaps the backward pass."""
    overlap_param_gather: bool = False
    """--overlap-param-gather: distributed-optimizer all-gather overlaps the forward pass."""
    overlap_param_gather_with_optimizer_step: bool = False
    """--overlap-param-gather-with-optimizer-step: the first model chunk's all-gather starts inside
    the optimizer step, behind the other chunks' updates (interleaved schedule only)."""
    expert_model_parallel_size: int = 1
    """--expert-model-parallel-size: routed experts split over this many ranks (MoE)."""
    expert_tensor_parallel_size: int | None = None
    """--expert-tensor-parallel-size: each expert's GEMMs split over this many ranks; None: TP (Megatron's default)."""
    context_parallel_size: int = 1
    """--context-parallel-size: the sequence split over this many ranks (two chunks each, for causal balance)."""
    cp_comm_type: CpCommType = "p2p"
    """--cp-comm-type: how attention exchanges keys and values across context-parallel ranks."""
    overlap_moe_expert_parallel_comm: bool = False
    """--overlap-moe-expert-parallel-comm: the 1F1B steady state runs one micro-batch's forward and
    another's backward layer by layer together, each one's dispatch and combine beside the other's
    compute (megatron-core's combined 1F1B schedule)."""
    delay_wgrad_compute: bool = False
    """--delay-wgrad-compute: under that overlap, the experts' weight-gradient GEMMs run after the
    backward dispatch is issued, so it need not wait for them."""
    use_megatron_fsdp: bool = False
    """--use-megatron-fsdp: Megatron-FSDP shards the model state over the data-parallel group as
    --data-parallel-sharding-strategy says, gathering each layer's parameters when it runs (cost.fsdp)."""
    data_parallel_sharding_strategy: ShardingStrategy = "optim_grads_params"
    """--data-parallel-sharding-strategy: what Megatron-FSDP shards: optimizer state (optim), and the
    gradients (optim_grads), and the parameters (optim_grads_params); read only under --use-megatron-fsdp."""
    cpu_offloading_num_layers: int = 0
    """--cpu-offloading-num-layers: the activations of the model's first N transformer layers are copied
    to host memory after their forward and back before their backward (cost.offload); 0: none."""

    def __post_init__(self) -> None:
        if isinstance(self.recompute_modules, list):     # from a plan document or Megatron's args
            object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @cached_property
    def selective_modules(self) -> frozenset[str]:
        """What selective recomputation redoes in every layer (nothing without it)."""
        if self.recompute_granularity != "selective":
            return frozenset()
        return DEFAULT_RECOMPUTE_MODULES if self.recompute_modules is None else frozenset(self.recompute_modules)

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def dp(self) -> int:
        return self.data_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size, resolved: Megatron sets an unset one to TP."""
        return self.tp if self.expert_tensor_parallel_size is None else self.expert_tensor_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_data_parallel_size(self) -> int:
        """Megatron's expert grid: world / (ETP x EP x PP) (parallel_state.initialize_model_parallel)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def describe(self) -> str:
        """A short label: tp2 cp2 ep4 pp4 dp8 mbs1 lpv2 first6 last6 sp dopt+opg rc=full/uniform1 (each
        abbreviation's meaning in ABBREVIATIONS, which `legend` prints)."""
        return " ".join(text for text, _ in self._labels())

    def abbreviations(self) -> list[str]:
        """The ABBREVIATIONS keys its label uses, in the label's order."""
        return [key for _, keys in self._labels() for key in keys]

    def _labels(self) -> list[tuple[str, tuple[str, ...]]]:
        """Each part of the label, with the ABBREVIATIONS it is made of (one source for both)."""
        parts = [(f"tp{self.tp}", ("tp",)), *([(f"cp{self.cp}", ("cp",))] if self.cp > 1 else []),
                 *([(f"ep{self.ep}", ("ep",))] if self.ep > 1 else []),
                 *([(f"etp{self.etp}", ("etp",))] if self.expert_tensor_parallel_size is not None else []),
                 (f"pp{self.pp}", ("pp",)), (f"dp{self.dp}", ("dp",)), (f"mbs{self.micro_batch_size}", ("mbs",))]
        if self.num_layers_per_virtual_pipeline_stage:
            parts.append((f"lpv{self.num_layers_per_virtual_pipeline_stage}", ("lpv",)))
        if self.pipeline_model_parallel_layout is not None:
            parts.append((f"layout={self.pipeline_model_parallel_layout}", ("layout=",)))
        if self.decoder_first_pipeline_num_layers is not None:
            parts.append((f"first{self.decoder_first_pipeline_num_layers}", ("first",)))
        if self.decoder_last_pipeline_num_layers is not None:
            parts.append((f"last{self.decoder_last_pipeline_num_layers}", ("last",)))
        if self.account_for_embedding_in_pipeline_split:
            parts.append(("+emb", ("+emb",)))
        if self.account_for_loss_in_pipeline_split:
            parts.append(("+loss", ("+loss",)))
        if self.sequence_parallel:
            parts.append(_joined("sp", ("+tpo", self.tp_comm_overlap)))
        if self.overlap_moe_expert_parallel_comm:
            parts.append(_joined("epo", ("+dw", self.delay_wgrad_compute)))
        if self.use_megatron_fsdp:
            parts.append((f"fsdp/{self.data_parallel_sharding_strategy}", ("fsdp/",)))
        if self.cpu_offloading_num_layers:
            parts.append((f"cpuoff{self.cpu_offloading_num_layers}", ("cpuoff",)))
        if self.use_distributed_optimizer:
            parts.append(_joined("dopt", ("+opg", self.overlap_param_gather),
                                 ("+step", self.overlap_param_gather_with_optimizer_step)))
        if self.recompute_granularity == "selective":
            parts.append(("rc=sel" + ("" if self.recompute_modules is None else "/" + "+".join(self.recompute_modules)),
                          ("rc=sel",)))
        elif self.recompute_granularity == "full":
            parts.append((f"rc=full/{self.recompute_method}{self.recompute_num_layers}", ("rc=full",)))
        return parts

    def megatron_args(self) -> list[str]:
        """The Megatron command-line flags that select this layout."""
        args = [f"--tensor-model-parallel-size {self.tp}", f"--pipeline-model-parallel-size {self.pp}",
                f"--micro-batch-size {self.micro_batch_size}"]
        args += [f"{flag} {value}" for flag, value, default in (
            ("--context-parallel-size", self.cp, 1), ("--cp-comm-type", self.cp_comm_type, "p2p"),
            ("--expert-model-parallel-size", self.ep, 1),
            ("--expert-tensor-parallel-size", self.expert_tensor_parallel_size, None)) if value != default]
        optional = (
            ("--num-layers-per-virtual-pipeline-stage", self.num_layers_per_virtual_pipeline_stage),
            ("--pipeline-model-parallel-layout",
             None if self.pipeline_model_parallel_layout is None else f'"{self.pipeline_model_parallel_layout}"'),
            ("--decoder-first-pipeline-num-layers", self.decoder_first_pipeline_num_layers),
            ("--decoder-last-pipeline-num-layers", self.decoder_last_pipeline_num_layers),
            ("--recompute-granularity", self.recompute_granularity),
            ("--recompute-method", self.recompute_method),
            ("--recompute-num-layers", self.recompute_num_layers),
            ("--recompute-modules", None if self.recompute_modules is None else " ".join(self.recompute_modules)),
            ("--cpu-offloading-num-layers", self.cpu_offloading_num_layers or None),
        )
        args += [f"{flag} {value}" for flag, value in optional if value is not None]
        if self.use_megatron_fsdp:      # the strategy is read only under FSDP
            args.append(f"--data-parallel-sharding-strategy {self.data_parallel_sharding_strategy}")
        switches = (("--sequence-parallel", self.sequence_parallel), ("--tp-comm-overlap", self.tp_comm_overlap),
                    ("--use-distributed-optimizer", self.use_distributed_optimizer),
                    ("--overlap-grad-reduce", self.overlap_grad_reduce),
                    ("--overlap-param-gather", self.overlap_param_gather),
                    ("--overlap-param-gather-with-optimizer-step", self.overlap_param_gather_with_optimizer_step),
                    ("--account-for-embedding-in-pipeline-split", self.account_for_embedding_in_pipeline_split),
                    ("--account-for-loss-in-pipeline-split", self.account_for_loss_in_pipeline_split),
                    ("--overlap-moe-expert-parallel-comm", self.overlap_moe_expert_parallel_comm),
                    ("--delay-wgrad-compute", self.delay_wgrad_compute),
                    ("--use-megatron-fsdp", self.use_megatron_fsdp))
        return args + [flag for flag, on in switches if on]


def check_user_layout(layout: Layout) -> None:
    """Reject values no layout could have (PipetteError: the user's input is wrong)."""
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                 "micro_batch_size", "expert_model_parallel_size", "context_parallel_size"):
        check_count(name, getattr(layout, name))
    for name in ("num_layers_per_virtual_pipeline_stage", "recompute_num_layers", "expert_tensor_parallel_size"):
        if getattr(layout, name) is not None:
            check_count(name, getattr(layout, name))
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        value = getattr(layout, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SIZE):
            raise PipetteError(f"{megatron_flag(name)} must be an integer in 0..{MAX_SIZE}, got {shown(value)}")
    if layout.recompute_granularity not in RECOMPUTE_GRANULARITIES:
        raise PipetteError(f"--recompute-granularity must be selective or full, got {layout.recompute_granularity!r}")
    if layout.recompute_method not in RECOMPUTE_METHODS:
        raise PipetteError(f"--recompute-method must be uniform or block, got {layout.recompute_method!r}")
    if layout.data_parallel_sharding_strategy not in SHARDING_STRATEGIES:
        raise PipetteError(f"--data-parallel-sharding-strategy {shown(layout.data_parallel_sharding_strategy)}: the "
                           f"cost model prices {', '.join(SHARDING_STRATEGIES)} (no_shard is not modelled)")
    if layout.cp_comm_type not in CP_COMM_TYPES:
        raise PipetteError(f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got {layout.cp_comm_type!r}")
    unknown = [m for m in layout.recompute_modules or () if m not in RECOMPUTE_MODULES]
    if unknown:
        raise PipetteError(f"--recompute-modules {' '.join(unknown)}: the cost model prices only "
                           f"{', '.join(RECOMPUTE_MODULES)}")


def megatron_sequence_parallel(tp: int, sequence_parallel: bool) -> bool:
    """--sequence-parallel as Megatron runs it: its validate_args turns it off at TP 1 rather than
    refusing it (megatron/training/arguments.py, megatron-core 0.19.2 lines 1390-1399: "Disabling
    sequence parallelism because tensor model parallelism is disabled"), so NVIDIA's TP 1 launch lines
    with it run, and plan, without it."""
    return sequence_parallel and tp > 1


def _accounted_flags(layout: Layout) -> list[str]:
    return [flag for flag, on in (("--account-for-embedding-in-pipeline-split",
                                   layout.account_for_embedding_in_pipeline_split),
                                  ("--account-for-loss-in-pipeline-split", layout.account_for_loss_in_pipeline_split))
            if on]


def stage_layers(workload: Workload, layout: Layout) -> list[int]:
    """Transformer layers on each pipeline stage, as Megatron splits them.

    Example: 30 layers, PP 4, first 6, last 6 -> [6, 9, 9, 6]. With the embedding and the loss
    counted as layers (megatron-core's get_num_layers_to_build): 126 layers, PP 8 -> 128 / 8,
    [15, 16, 16, 16, 16, 16, 16, 15].
    """
    if layout.pipeline_model_parallel_layout is not None:
        return [sum(chunks) for chunks in _spelt_chunks(workload, layout)]
    pp, layers = layout.pp, workload.num_layers
    first, last = layout.decoder_first_pipeline_num_layers, layout.decoder_last_pipeline_num_layers
    accounted = _accounted_flags(layout)
    if accounted:
        if first is not None or last is not None:
            raise Infeasible(f"{accounted[0]} cannot be combined with --decoder-first/last-pipeline-num-layers")
        counted = layers + len(accounted)
        if counted % pp:
            raise Infeasible(f"--num-layers {layers} plus the {len(accounted)} layer(s) of {' and '.join(accounted)} "
                             f"is not divisible by --pipeline-model-parallel-size {pp}")
        split = [counted // pp] * pp
        split[0] -= layout.account_for_embedding_in_pipeline_split
        split[-1] -= layout.account_for_loss_in_pipeline_split
        if min(split) < 0:
            raise Infeasible(f"--num-layers {layers} with {accounted[0]} is too few layers for "
                             f"--pipeline-model-parallel-size {pp}")
        return split
    if first is None and last is None:
        if layers % pp:
            raise Infeasible(f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {pp}")
        return [layers // pp] * pp
    if pp == 1:
        raise Infeasible("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
    middle_stages = pp - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    if rest < 0 or (middle_stages == 0 and rest) or (middle_stages and rest % middle_stages):
        raise Infeasible(f"--num-layers {layers} minus first {first} / last {last} stage layers does not "
                         f"divide evenly over the other {middle_stages} pipeline stages")
    each = rest // middle_stages if middle_stages else 0
    split = [each] * pp
    if first is not None:
        split[0] = first
    if last is not None:
        split[-1] = last
    return split


def chunk_sizes(workload: Workload, layout: Layout) -> list[list[int]]:
    """Transformer layers in each (pipeline stage, model chunk), as megatron-core builds them
    (get_num_layers_to_build): one chunk per stage without interleaving; with it, every chunk
    --num-layers-per-virtual-pipeline-stage layers, less the embedding's on the first stage's
    first chunk and the loss's on the last stage's last chunk where they count in the split.

    Example: 126 layers, PP 8, 4 layers a chunk, embedding and loss counted: 128 / 8 = 16 per
    stage, 4 chunks each, stage 0 [3, 4, 4, 4], stage 7 [4, 4, 4, 3]."""
    if layout.pipeline_model_parallel_layout is not None:
        return _spelt_chunks(workload, layout)
    layers = stage_layers(workload, layout)
    lpv = layout.num_layers_per_virtual_pipeline_stage
    if lpv is None:
        return [[n] for n in layers]
    if layout.pp == 1:
        raise Infeasible("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    embedding, loss = layout.account_for_embedding_in_pipeline_split, layout.account_for_loss_in_pipeline_split
    counted = [n + (r == 0) * embedding + (r == layout.pp - 1) * loss for r, n in enumerate(layers)]
    if len(set(counted)) != 1 or counted[0] % lpv or counted[0] == lpv:
        raise Infeasible(f"--num-layers-per-virtual-pipeline-stage {lpv} must divide the {counted[0]} layers "
                         f"of every pipeline stage into two or more chunks")
    sizes = [[lpv] * (counted[0] // lpv) for _ in layers]
    sizes[0][0] -= embedding
    sizes[-1][-1] -= loss
    return sizes


VIRTUAL_STAGES = "num_virtual_stages_per_pipeline_rank"
"""Megatron's other spelling of interleaving, --num-virtual-stages-per-pipeline-rank: model chunks per
pipeline rank, not layers per chunk. Not a Layout field (a layout has one spelling:
--num-layers-per-virtual-pipeline-stage); typed flags that give it are converted by
virtual_stages_as_layers."""


def virtual_stages_as_layers(num_layers: int, typed: Mapping[str, Any]) -> dict[str, Any]:
    """Typed layout flags (Layout field names, and VIRTUAL_STAGES) with --num-virtual-stages-per-pipeline-rank
    N turned into the --num-layers-per-virtual-pipeline-stage that builds the same chunks, and the
    split pinned to the one the flags give (so a search keeps N chunks a rank).

    megatron-core 0.19.2: validate_args takes N as the virtual pipeline size itself
    (megatron/training/arguments.py:942-945; N = 1 is no interleaving) and refuses it beside
    --num-layers-per-virtual-pipeline-stage or --pipeline-model-parallel-layout (894-905), and at
    --pipeline-model-parallel-size 1 (966-974); get_num_layers_to_build then gives every chunk the
    stage's layers (the embedding and loss counted where the split counts them) over N, asserting
    that N divides them (core/transformer/transformer_block.py:169-173, transformer_config.py:2097-2110),
    which is what the other flag's layers a chunk give (chunk_sizes). With uneven first/last stages
    Megatron builds chunks of different sizes per stage, which no Layout describes: refused here."""
    n = typed.get(VIRTUAL_STAGES)
    if n is None:
        return dict(typed)
    check_count(VIRTUAL_STAGES, n)
    flag = f"{megatron_flag(VIRTUAL_STAGES)} {n}"
    for other in ("num_layers_per_virtual_pipeline_stage", "pipeline_model_parallel_layout"):
        if typed.get(other) is not None:
            raise PipetteError(f"{flag} cannot be combined with {megatron_flag(other)} (Megatron's rule: "
                               "no more than one of them)")
    if "pipeline_model_parallel_size" not in typed:
        raise PipetteError(f"{flag} needs --pipeline-model-parallel-size beside it (the layers a virtual stage "
                           "holds depend on it; --num-layers-per-virtual-pipeline-stage does not)")
    pp = typed["pipeline_model_parallel_size"]
    check_count("pipeline_model_parallel_size", pp)
    fields = {k: v for k, v in typed.items() if k != VIRTUAL_STAGES}
    split = {name: typed.get(name, False) for name in ("account_for_embedding_in_pipeline_split",
                                                       "account_for_loss_in_pipeline_split")}
    if n > 1 and pp == 1:
        raise PipetteError(f"{flag} needs --pipeline-model-parallel-size > 1 (Megatron's rule)")
    if n > 1 and (typed.get("decoder_first_pipeline_num_layers") is not None
                  or typed.get("decoder_last_pipeline_num_layers") is not None):
        raise PipetteError(f"{flag} with --decoder-first/last-pipeline-num-layers is not modelled (chunks of "
                           "different sizes per stage)")
    if n == 1:
        return {**fields, **split, "num_layers_per_virtual_pipeline_stage": None}
    counted = num_layers + sum(split.values())
    if counted % pp or (counted // pp) % n:
        raise PipetteError(f"{flag} must divide the layers of every pipeline stage (--num-layers {num_layers}"
                           f"{' with the embedding and loss counted' if any(split.values()) else ''} over "
                           f"--pipeline-model-parallel-size {pp}; Megatron's rule)")
    return {**fields, **split, "num_layers_per_virtual_pipeline_stage": counted // pp // n}


def parse_pipeline_layout(text: str) -> list[str]:
    """The virtual stages of a --pipeline-model-parallel-layout string, in order, one string of
    layer letters each: megatron-core's PipelineParallelLayerLayout.parse_str_to_list (commas are
    cosmetic; "(...)*n" and "x*n" repeat)."""
    if len(text) > MAX_TEXT:
        raise PipetteError(f"--pipeline-model-parallel-layout: {len(text)} characters, more than {MAX_TEXT}")
    unrolled = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        repeats = [(len(m.group(1)), m.group(2)) for m in re.finditer(pattern, unrolled)]
        if sum(width * int(n) if len(n) <= 9 else MAX_LAYOUT_LENGTH + 1 for width, n in repeats) > MAX_LAYOUT_LENGTH:
            raise PipetteError(f"--pipeline-model-parallel-layout {shown(text)}: its repeats spell more than "
                               f"{MAX_LAYOUT_LENGTH} letters")
        unrolled = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), unrolled)
    stages = unrolled.split("|")
    odd = sorted({c for stage in stages for c in stage} - set(LAYOUT_LETTERS))
    if odd:
        raise PipetteError(f"--pipeline-model-parallel-layout {text}: unknown layer letter(s) {' '.join(odd)} "
                           f"(E embedding, t transformer layer, L loss, m MTP layer)")
    return stages


def _spelt_chunks(workload: Workload, layout: Layout) -> list[list[int]]:
    """Transformer layers per (stage, chunk) of a --pipeline-model-parallel-layout, with Megatron's
    rules (TransformerConfig, PipelineParallelLayerLayout.validate_layer_layout): virtual stage i is
    pipeline rank i % PP's chunk i // PP; the embedding first and the loss last, once each; every
    transformer layer once."""
    text, pp = layout.pipeline_model_parallel_layout, layout.pp
    stages = parse_pipeline_layout(text)
    flag = f"--pipeline-model-parallel-layout {text}"
    for other, on in (("--num-layers-per-virtual-pipeline-stage", layout.num_layers_per_virtual_pipeline_stage),
                      ("--decoder-first-pipeline-num-layers", layout.decoder_first_pipeline_num_layers),
                      ("--decoder-last-pipeline-num-layers", layout.decoder_last_pipeline_num_layers),
                      *((f, True) for f in _accounted_flags(layout))):
        if on is not None:
            raise Infeasible(f"{flag} cannot be combined with {other}")
    if len(stages) % pp:
        raise Infeasible(f"{flag} has {len(stages)} stages, not a multiple of --pipeline-model-parallel-size {pp}")
    flat = "".join(stages)
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 or flat.count("L") != 1:
        raise Infeasible(f"{flag} must start with the embedding (E) and end with the loss (L), once each")
    if flat.count("m") != workload.mtp_layers:
        wanted = f"not --mtp-num-layers {workload.mtp_num_layers}" if workload.mtp_num_layers else \
            "without --mtp-num-layers"
        raise Infeasible(f"{flag} places {flat.count('m')} multi-token-prediction layers (m), {wanted} "
                         "(Megatron's rule)")
    if "m" in flat and ("m" in "".join(stages[:-1]) or "t" in stages[-1][stages[-1].index("m"):]):
        raise Infeasible(f"{flag} places multi-token-prediction layers (m) before the last virtual stage's end: "
                         "only there, after its transformer layers (as Megatron runs them without "
                         "--mtp-standalone), are they modelled")
    if flat.count("t") != workload.num_layers:
        raise Infeasible(f"{flag} places {flat.count('t')} transformer layers, not --num-layers {workload.num_layers}")
    v = len(stages) // pp
    if v > 1 and pp == 1:
        raise Infeasible(f"{flag} splits one pipeline stage into {v} model chunks: interleaving needs "
                         f"--pipeline-model-parallel-size > 1")
    return [[stages[c * pp + r].count("t") for c in range(v)] for r in range(pp)]


def check_tensor_parallel_size(workload: Workload, tp: int) -> None:
    """Raise Infeasible unless TP divides the model's heads, query groups and FFN (a rule of the TP size
    alone, which the search also uses to choose what a layer profile times)."""
    if workload.num_attention_heads % tp:
        raise Infeasible(f"--num-attention-heads {workload.num_attention_heads} is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    if workload.query_groups % tp:
        raise Infeasible(f"--num-query-groups {workload.query_groups} is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    if workload.ffn % tp:
        raise Infeasible(f"--ffn-hidden-size {workload.ffn} is not divisible by --tensor-model-parallel-size {tp}")


def validate_layout(workload: Workload, layout: Layout, world_size: int | None = None) -> None:
    """Raise Infeasible, naming the flags, if Megatron would reject this layout."""
    check_user_layout(layout)
    tp, pp, dp, mbs = layout.tp, layout.pp, layout.dp, layout.micro_batch_size
    if world_size is not None and layout.world_size != world_size:
        raise Infeasible(f"TP {tp} x CP {layout.cp} x PP {pp} x DP {dp} = {layout.world_size} GPUs, "
                         f"not the {world_size} given")
    check_tensor_parallel_size(workload, tp)
    if workload.global_batch_size % (mbs * dp):
        raise Infeasible(f"--global-batch-size {workload.global_batch_size} is not divisible by "
                         f"--micro-batch-size {mbs} x data-parallel size {dp}")
    if layout.sequence_parallel and tp == 1:
        raise Infeasible("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if layout.tp_comm_overlap and not layout.sequence_parallel:
        raise Infeasible("--tp-comm-overlap needs --sequence-parallel (Megatron's rule)")
    if layout.tp_comm_overlap and workload.multi_latent_attention:
        raise Infeasible("--tp-comm-overlap with --multi-latent-attention is not modelled (its down and up "
                         "projections overlap their collectives differently)")
    if layout.sequence_parallel and workload.seq_length % tp:
        raise Infeasible(f"--seq-length {workload.seq_length} is not divisible by --tensor-model-parallel-size {tp}"
                         " (needed by --sequence-parallel)")
    layers = stage_layers(workload, layout)
    if min(layers) == 0 and layout.pipeline_model_parallel_layout is None:   # a spelt-out layout may
        raise Infeasible("a pipeline stage would hold no transformer layer")       # (E|t*8|t*8|L)
    _validate_recompute(layout, layers)
    if "mla_up_proj" in layout.selective_modules and layout.recompute_granularity == "selective" \
            and not workload.multi_latent_attention:
        raise Infeasible("--recompute-modules mla_up_proj needs --multi-latent-attention (as in Megatron)")
    interleaved = len(chunk_sizes(workload, layout)[0]) > 1
    if interleaved:
        m = workload.global_batch_size // (mbs * dp)
        if m % pp:
            raise Infeasible(f"the interleaved schedule needs the number of micro-batches ({m}) to be a "
                             f"multiple of --pipeline-model-parallel-size {pp}")
    if layout.overlap_param_gather and not layout.use_distributed_optimizer:
        raise Infeasible("--overlap-param-gather needs --use-distributed-optimizer")
    if layout.overlap_param_gather and not layout.overlap_grad_reduce:
        raise Infeasible("--overlap-param-gather needs --overlap-grad-reduce (Megatron's rule)")
    if layout.overlap_param_gather_with_optimizer_step and not (layout.overlap_param_gather and interleaved):
        raise Infeasible("--overlap-param-gather-with-optimizer-step needs --overlap-param-gather and the "
                         "interleaved schedule (Megatron's rule)")
    _validate_context_parallel(workload, layout)
    _validate_experts(workload, layout)
    _validate_fsdp(workload, layout)
    _validate_cpu_offloading(workload, layout)
    if workload.cuda_graph_impl in ("local", "transformer_engine") and layout.recompute_granularity == "full":
        raise Infeasible(f"--recompute-granularity full with --cuda-graph-impl {workload.cuda_graph_impl}: "
                         "megatron-core 0.19.2 runs full recomputation with the full_iteration graph only "
                         "(TransformerConfig asserts)")


def _validate_cpu_offloading(workload: Workload, layout: Layout) -> None:
    """megatron-core 0.19.2's rules for --cpu-offloading-num-layers (TransformerConfig.__post_init__;
    megatron/training/arguments.py turns --cpu-offloading on for N > 0)."""
    n = layout.cpu_offloading_num_layers
    if not n:
        return
    flag = f"--cpu-offloading-num-layers {n}"
    if not 0 < n < workload.num_layers:
        raise Infeasible(f"{flag}: CPU offloading can be done only for layers less than --num-layers "
                         f"{workload.num_layers} (Megatron's rule)")
    if layout.pp > 1:
        raise Infeasible(f"{flag} with --pipeline-model-parallel-size {layout.pp}: Megatron has no support for "
                         "pipeline parallelism with CPU offloading (Megatron's rule)")
    if layout.recompute_granularity is not None:
        raise Infeasible(f"{flag} with --recompute-granularity {layout.recompute_granularity}: CPU offloading does "
                         "not work when activation recomputation is enabled (Megatron's rule)")
    if workload.cuda_graph_impl not in ("none", "full_iteration"):
        raise Infeasible(f"{flag} with --cuda-graph-impl {workload.cuda_graph_impl}: CUDA graphs not supported "
                         "with CPU offloading (Megatron's rule)")


def _validate_fsdp(workload: Workload, layout: Layout) -> None:
    """megatron/training/arguments.py's rules for --use-megatron-fsdp (megatron-core 0.19.2), and the
    combinations cost.fsdp does not price."""
    if not layout.use_megatron_fsdp:
        return
    flag = f"--use-megatron-fsdp --data-parallel-sharding-strategy {layout.data_parallel_sharding_strategy}"
    if not layout.use_distributed_optimizer:
        raise Infeasible(f"{flag} runs with --use-distributed-optimizer (validate_args turns it on): give it")
    if layout.pp > 1:
        raise Infeasible(f"{flag} with --pipeline-model-parallel-size {layout.pp} is not modelled (each "
                         "micro-batch's layer gathers under a pipeline's warmup and cooldown; no published run "
                         "to check them against)")
    if layout.overlap_moe_expert_parallel_comm:
        raise Infeasible(f"{flag} with --overlap-moe-expert-parallel-comm is not modelled (megatron-fsdp then "
                         "gathers each sub-module apart, fine-grained hooks)")
    if workload.fp8_recipe == "mxfp8" and workload.fp8_param_gather and workload.fp8 is not None:
        raise Infeasible(f"{flag} with --fp8-recipe mxfp8 and --fp8-param-gather is not modelled (validate_args "
                         "turns --reuse-grad-buf-for-mxfp8-param-ag off; megatron-fsdp then gathers MXFP8's "
                         "rowwise and columnwise weights apart)")


def _validate_context_parallel(workload: Workload, layout: Layout) -> None:
    """megatron/training/arguments.py: s % (2 CP) == 0 (two chunks per rank); with SP the embedding
    scatters s/CP tokens over TP (tensor_parallel/mappings.py)."""
    cp, s = layout.cp, workload.seq_length
    if cp == 1:
        return
    if s % (2 * cp):
        raise Infeasible(f"--seq-length {s} is not divisible by 2 x --context-parallel-size {cp}")
    if layout.sequence_parallel and (s // cp) % layout.tp:
        raise Infeasible(f"--seq-length {s} / --context-parallel-size {cp} is not divisible by "
                         f"--tensor-model-parallel-size {layout.tp} (needed by --sequence-parallel)")
    if any(workload.window_layer_pattern()):
        raise Infeasible(f"--context-parallel-size {cp} with --window-size {workload.window_size}: sliding-window "
                         "attention under context parallelism is not modelled")
    if workload.attention_backend in ("unfused", "local"):
        raise Infeasible(f"--context-parallel-size {cp} needs Transformer Engine's attention, not "
                         f"--attention-backend {workload.attention_backend}")
    if layout.cp_comm_type == "a2a" and (workload.num_attention_heads // layout.tp % cp
                                         or workload.query_groups // layout.tp % cp):
        raise Infeasible(f"--cp-comm-type a2a splits the heads of a TP rank over --context-parallel-size {cp}: "
                         f"{workload.num_attention_heads} heads and {workload.query_groups} query groups / TP "
                         f"{layout.tp} do not divide by it")


def check_implementation(layout: Layout, transformer_engine: bool) -> None:
    """Raise Infeasible, naming the flag, if the layout needs Transformer Engine's layers and the job
    has none (--transformer-impl local, or Transformer Engine not installed): TRANSFORMER_ENGINE_ONLY.
    Apart from validate_layout, since the workload does not say which layers Megatron builds."""
    if transformer_engine:
        return
    for name, rule in TRANSFORMER_ENGINE_ONLY.items():
        if getattr(layout, name):
            raise Infeasible(f"{megatron_flag(name)} needs Transformer Engine (installed, and --transformer-impl "
                             f"transformer_engine): {rule}")


def _validate_experts(workload: Workload, layout: Layout) -> None:
    """The MoE rules of megatron/training/arguments.py, core/parallel_state.py and moe_layer.py."""
    ep, etp = layout.ep, layout.etp
    if workload.num_experts is None:
        if ep > 1 or layout.expert_tensor_parallel_size is not None:
            raise Infeasible("--expert-model-parallel-size and --expert-tensor-parallel-size need --num-experts")
        if layout.overlap_moe_expert_parallel_comm or layout.delay_wgrad_compute:
            raise Infeasible("--overlap-moe-expert-parallel-comm and --delay-wgrad-compute need --num-experts (a "
                             "dense model has no expert parallelism to overlap: TransformerConfig asserts "
                             "--expert-model-parallel-size > 1)")
        return
    if workload.num_experts % ep:
        raise Infeasible(f"--num-experts {workload.num_experts} is not divisible by "
                         f"--expert-model-parallel-size {ep}")
    if layout.world_size % (etp * ep * layout.pp):
        raise Infeasible(f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep} x "
                         f"--pipeline-model-parallel-size {layout.pp} does not divide the {layout.world_size} GPUs")
    width = workload.moe_ffn * workload.fc1_widening
    if width % etp or workload.moe_ffn % etp:
        raise Infeasible(f"--moe-ffn-hidden-size {workload.moe_ffn} is not divisible by "
                         f"--expert-tensor-parallel-size {etp}")
    if etp > 1 and workload.add_bias_linear:
        raise Infeasible(f"expert biases (no --disable-bias-linear) need --expert-tensor-parallel-size 1, not {etp}")
    if layout.tp > 1 and not layout.sequence_parallel:
        raise Infeasible("mixture-of-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                         "(MoELayer.forward raises without it)")
    if workload.moe_token_dispatcher_type == "flex" and ep * etp == 1:
        raise Infeasible("--moe-token-dispatcher-type flex needs --expert-tensor-parallel-size x "
                         "--expert-model-parallel-size above 1 (MoEFlexTokenDispatcher asserts it)")
    _validate_expert_overlap(workload, layout)
    _validate_expert_rank_budget(workload, layout)


def _validate_expert_rank_budget(workload: Workload, layout: Layout) -> None:
    """What cost.experts does not price of HybridEP's budget and the paged stash: a budget or a device
    stash below the rows a rank receives under balanced routing (T k ETP; the budget is T k x the
    factor, the stash |f| x T k, or x the rows received for f < 0) drops tokens or overflows every
    step, and PagedStashRunner reruns each step dropless (or the stash spills to host memory)."""
    factor = workload.moe_expert_rank_capacity_factor
    if factor is None:
        return
    etp = layout.etp
    if factor < etp:
        raise Infeasible(f"--moe-expert-rank-capacity-factor {factor} below the {etp} x T k rows a rank receives "
                         f"under balanced routing (--expert-tensor-parallel-size {etp}): every step would overflow "
                         "the budget and rerun dropless, which is not modelled")
    if not workload.moe_paged_stash:
        return
    stash = workload.moe_paged_stash_buffer_size_factor_cuda
    if abs(stash) < (etp if stash >= 0 else 1):
        raise Infeasible(f"--moe-paged-stash-buffer-size-factor-cuda {stash} holds fewer rows than are in flight "
                         "under balanced routing: every step would spill to host memory or rerun, which is not "
                         "modelled")
    if layout.recompute_granularity == "full" or {"moe", "moe_act"} & set(layout.selective_modules):
        raise Infeasible("--moe-paged-stash with the routed experts recomputed (--recompute-granularity full, "
                         "--recompute-modules moe or moe_act) is not modelled")
    if layout.cpu_offloading_num_layers:
        raise Infeasible("--moe-paged-stash cannot be enabled with --cpu-offloading-num-layers (megatron-core "
                         "0.19.2's TransformerConfig asserts it)")


def _validate_expert_overlap(workload: Workload, layout: Layout) -> None:
    """TransformerConfig.__post_init__'s rules for --overlap-moe-expert-parallel-comm and
    --delay-wgrad-compute (megatron-core 0.19), and what the cost model does not price with them."""
    if layout.delay_wgrad_compute and not layout.overlap_moe_expert_parallel_comm:
        raise Infeasible("--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (Megatron's rule)")
    if not layout.overlap_moe_expert_parallel_comm:
        return
    flag = "--overlap-moe-expert-parallel-comm"
    if layout.ep == 1:
        raise Infeasible(f"{flag} needs --expert-model-parallel-size > 1 (Megatron's rule)")
    if workload.moe_token_dispatcher_type not in ("alltoall", "flex"):
        raise Infeasible(f"{flag} needs --moe-token-dispatcher-type alltoall or flex, not "
                         f"{workload.moe_token_dispatcher_type} (Megatron's rule)")
    if layout.pp > 1 and len(chunk_sizes(workload, layout)[0]) == 1:
        raise Infeasible(f"{flag} with --pipeline-model-parallel-size {layout.pp} needs the interleaved schedule "
                         "(--num-layers-per-virtual-pipeline-stage or a --pipeline-model-parallel-layout; "
                         "Megatron's rule)")
    if layout.recompute_granularity == "full":
        raise Infeasible(f"{flag} excludes --recompute-granularity full (Megatron's rule)")
    if layout.recompute_granularity == "selective" and "moe" in layout.selective_modules:
        raise Infeasible(f"{flag} excludes --recompute-modules moe (Megatron's rule)")
    if workload.mtp_layers > 1:
        raise Infeasible(f"{flag} allows at most one --mtp-num-layers, not {workload.mtp_layers} (Megatron's rule)")
    if workload.precision not in ("bf16", "fp16"):
        raise Infeasible(f"{flag} needs --bf16 or --fp16, not {workload.precision} (Megatron's rule)")
    if workload.window is not None:
        raise Infeasible(f"{flag} with --window-size is not modelled (the overlap is priced with full attention)")


def _validate_recompute(layout: Layout, layers: list[int]) -> None:
    g, method, n = layout.recompute_granularity, layout.recompute_method, layout.recompute_num_layers
    if g == "full":
        if method is None:
            raise Infeasible("--recompute-granularity full needs --recompute-method uniform or block")
        if n is None:
            raise Infeasible("--recompute-granularity full needs --recompute-num-layers")
        if method == "block" and n > min(layers):
            raise Infeasible(f"--recompute-num-layers {n} exceeds the {min(layers)} layers of a pipeline stage")
    elif method is not None or n is not None:
        raise Infeasible("--recompute-method and --recompute-num-layers apply only with --recompute-granularity full")
    if layout.recompute_modules is not None and g != "selective":
        raise Infeasible("--recompute-modules applies only with --recompute-granularity selective")


def _joined(head: str, *tails: tuple[str, bool]) -> tuple[str, tuple[str, ...]]:
    """A label part with its switched-on suffixes ("dopt+opg"), and the abbreviations it uses."""
    keys = (head, *(tail for tail, on in tails if on))
    return "".join(keys), keys


def legend(layouts: list[Layout]) -> str:
    """One line saying what the abbreviations of these layouts' labels stand for (only those used)."""
    keys = dict.fromkeys(key for layout in layouts for key in layout.abbreviations())
    return "Abbreviations: " + "; ".join(f"{key} {ABBREVIATIONS[key]}" for key in keys) + "."
