"""Enumerate every layout Megatron accepts for a world size, within the user's constraints.

Flags the user set explicitly (`--tensor-model-parallel-size 8` beside
`--auto-parallel`) arrive as `constraints`: a mapping from Layout field name to
the fixed value. Everything else is searched. The enumeration is exhaustive
over Megatron's choices, except for the few restrictions documented here:
tensor parallel stays inside a node (or an NVLink domain of several) unless
`allow_tp_across_nodes`, context parallelism leaves each rank at least
CP_MIN_TOKENS of the sequence, the expert tensor-parallel size is TP or 1, uneven
pipeline splits only shorten the first and/or last stage (Megatron's
--decoder-first/last-pipeline-num-layers), the two nearest splits of each kind, and full
recomputation is searched in Megatron's recommended form (uniform, 1 layer
per group); block recomputation is available as a constraint. `profile_shapes` gives the per-rank
sizes of those layouts, which the hook's layer profile times.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from itertools import product
from typing import Any

from megatron_pipette.errors import Infeasible, PipetteError
from megatron_pipette.spec.job import Job, resolve_job
from megatron_pipette.spec.layout import Layout, check_tensor_parallel_size, megatron_sequence_parallel
from megatron_pipette.spec.resume import ResumeRule
from megatron_pipette.spec.workload import Workload, megatron_flag

LAYOUT_FIELDS = {f.name for f in fields(Layout)}
MAX_MICRO_BATCH_SIZE = 32
"""Larger micro-batches only add memory once GEMMs are saturated; Megatron users stay far below."""
UNEVEN_SPLITS = 2
"""Uneven pipeline splits tried per kind (lighter last stage; lighter first and last stages)."""
CP_MIN_TOKENS = 4096
"""Context parallelism is searched down to this many tokens per rank (a constraint may go lower)."""


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) (n is a world size, a batch, a layer count)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


Split = tuple[int | None, int | None, bool]
"""(--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers, embedding and loss
counted in the split: --account-for-embedding/loss-in-pipeline-split)."""


def _pipeline_splits(num_layers: int, pp: int) -> list[Split]:
    """Split options: the even split, the two nearest splits with a lighter last stage and with
    lighter first and last stages (Megatron needs the middle stages equal), which offset the
    output layer with loss and the embedding, and the embedding and loss counted as layers, the
    one uneven split an interleaved pipeline can have (`_jobs` tries it interleaved only)."""
    if pp == 1:
        return [(None, None, False)]
    splits: list[Split] = [(None, None, False)] if num_layers % pp == 0 else []
    ceiling = -(-num_layers // pp)
    lighter_last = [(None, k, False) for k in range(ceiling - 1, 0, -1)
                    if (num_layers - k) % (pp - 1) == 0 and (num_layers - k) // (pp - 1) > k]
    lighter_ends = [(k, k, False) for k in range(ceiling - 1, 0, -1)
                    if pp > 2 and (num_layers - 2 * k) % (pp - 2) == 0 and (num_layers - 2 * k) // (pp - 2) > k]
    counted = [(None, None, True)] if (num_layers + 2) % pp == 0 else []
    return splits + lighter_last[:UNEVEN_SPLITS] + lighter_ends[:UNEVEN_SPLITS] + counted


RECOMPUTE_FLAGS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")
"""Given any of these, the user fixed the recomputation: the search and the planner keep it."""
SPLIT_FLAGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
               "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
               "pipeline_model_parallel_layout")
KEPT_AS_GIVEN = ("cp_comm_type", "recompute_modules", "pipeline_model_parallel_layout", "tp_comm_overlap",
                 "overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "use_megatron_fsdp",
                 "data_parallel_sharding_strategy", "cpu_offloading_num_layers")
"""Layout fields the search does not vary: the user's value, else Megatron's default (so it
chooses Megatron-FSDP and CPU offloading only where typed)."""
PREFERABLE = tuple(k for k in KEPT_AS_GIVEN if k not in ("recompute_modules", "pipeline_model_parallel_layout"))
"""KEPT_AS_GIVEN fields that may be `preferred` rather than fixed: settings whose validity depends on the
layout's sizes (--overlap-moe-expert-parallel-comm needs EP > 1, CPU offloading PP 1, ...), not sizes or
recomputation themselves."""


def _user_split(constraints: Mapping[str, Any]) -> list[Split] | None:
    """The split the user's flags fix, if any (the account flags themselves reach the layout
    from the constraints; the Layout validates the combination)."""
    if not any(k in constraints for k in SPLIT_FLAGS):
        return None
    return [(constraints.get("decoder_first_pipeline_num_layers"),
             constraints.get("decoder_last_pipeline_num_layers"), False)]


def _check_constraints(constraints: Mapping[str, Any]) -> None:
    unknown = set(constraints) - LAYOUT_FIELDS
    if unknown:
        raise PipetteError(f"unknown layout constraint(s): {', '.join(sorted(unknown))}")


def _check_preferred(preferred: Mapping[str, Any], constraints: Mapping[str, Any]) -> None:
    wrong = set(preferred) - set(PREFERABLE)
    if wrong:
        raise PipetteError(f"cannot prefer layout field(s) {', '.join(sorted(wrong))}: only {', '.join(PREFERABLE)}")
    if both := set(preferred) & set(constraints):
        raise PipetteError(f"layout field(s) {', '.join(sorted(both))} both constrained and preferred")


def fits_fast_domain(tp: int, gpus_per_node: int, gpus_per_domain: int) -> bool:
    """TP groups (consecutive ranks) stay inside one NVLink domain: inside a node, or whole nodes of
    one domain (GB200 NVL72: up to 18 nodes of 4)."""
    return gpus_per_node % tp == 0 or (tp % gpus_per_node == 0 and gpus_per_domain % tp == 0)


def rejection_kind(reason: Infeasible) -> str:
    """A rejection's reason with its numbers generalised, so that like rejections count together:
    "--num-attention-heads N is not divisible by --tensor-model-parallel-size N"."""
    return re.sub(r"\d+", "N", str(reason))


@dataclass
class Rejections:
    """The layouts Megatron would reject, counted by rejection_kind, with the first of each kind as
    it read (numbers and all) for a message that names the rule."""

    counts: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)

    def add(self, reason: Infeasible) -> None:
        kind = rejection_kind(reason)
        self.counts[kind] += 1
        self.examples.setdefault(kind, str(reason))


def enumerate_layouts(workload: Workload, world_size: int, gpus_per_node: int,
                      constraints: Mapping[str, Any] | None = None, *, allow_tp_across_nodes: bool = False,
                      gpus_per_domain: int | None = None, rejected: Rejections | None = None,
                      resume: ResumeRule | None = None, preferred: Mapping[str, Any] | None = None) -> Iterator[Job]:
    """Yield the job of every valid layout that honours the constraints and can load the checkpoint
    to resume from (`resume`: its equalities are constraints, the rest a predicate); count each layout
    Megatron would reject in `rejected` (a typed size that does not divide the GPUs among them; one that
    cannot load the checkpoint). `preferred` (PREFERABLE fields) are set together on each layout where
    Megatron accepts them there, and left at Megatron's defaults where it does not: how a recipe that
    sets them would be written for that layout, where a constraint would reject the layout instead."""
    constraints = {**(constraints or {}), **(resume.equalities if resume is not None else {})}
    _check_preferred(preferred or {}, constraints)
    rejected = rejected if rejected is not None else Rejections()

    def choices(name: str, options):
        return [constraints[name]] if name in constraints else list(options)

    for tp, cp, pp, dp in _grids(workload, world_size, gpus_per_node, constraints, allow_tp_across_nodes,
                                 gpus_per_domain, rejected):
        for ep, etp in _expert_options(workload, tp, pp, world_size, choices, constraints):
            sizes = {"context_parallel_size": cp, "expert_model_parallel_size": ep,
                     "expert_tensor_parallel_size": etp}
            yield from _layouts_for_grid(workload, tp, pp, dp, constraints, choices, rejected, sizes, resume,
                                         preferred or {})


def _grids(workload: Workload, world_size: int, gpus_per_node: int, constraints: Mapping[str, Any],
           allow_tp_across_nodes: bool, gpus_per_domain: int | None,
           rejected: Rejections) -> Iterator[tuple[int, int, int, int]]:
    """(TP, CP, PP, DP) of every grid the search walks (enumerate_layouts, profile_shapes), each grid
    Megatron would reject counted in `rejected`."""
    _check_constraints(constraints)
    domain = gpus_per_domain or gpus_per_node

    def choices(name: str, options):
        return [constraints[name]] if name in constraints else list(options)

    def divides(sizes: dict[str, int]) -> bool:
        """Whether the grid's sizes so far divide the GPUs; a typed one that does not is a rejection."""
        product = math.prod(sizes.values())
        if world_size % product and any(name in constraints for name in sizes):
            rejected.add(Infeasible(f"{' x '.join(f'{megatron_flag(k)} {v}' for k, v in sizes.items())} "
                                    f"does not divide the {world_size} GPUs"))
        return world_size % product == 0

    for tp in choices("tensor_model_parallel_size", divisors(world_size)):
        if not divides({"tensor_model_parallel_size": tp}) or (
                not allow_tp_across_nodes and "tensor_model_parallel_size" not in constraints
                and not fits_fast_domain(tp, gpus_per_node, domain)):
            continue
        for cp in choices("context_parallel_size", context_parallel_options(workload, world_size // tp)):
            if not divides({"tensor_model_parallel_size": tp, "context_parallel_size": cp}):
                continue
            for pp in choices("pipeline_model_parallel_size", divisors(world_size // (tp * cp))):
                if not divides({"tensor_model_parallel_size": tp, "context_parallel_size": cp,
                                "pipeline_model_parallel_size": pp}):
                    continue
                dp = world_size // (tp * cp * pp)
                if "data_parallel_size" in constraints and constraints["data_parallel_size"] != dp:
                    continue
                if workload.global_batch_size % dp:
                    rejected.add(Infeasible(f"--global-batch-size {workload.global_batch_size} is not divisible by "
                                            f"the data-parallel size {dp} ({world_size} GPUs / TP {tp} x CP {cp} x "
                                            f"PP {pp})"))
                    continue
                yield tp, cp, pp, dp


def micro_batch_options(per_replica: int) -> list[int]:
    """Micro-batch sizes searched for a replica's share of the global batch: its divisors up to
    MAX_MICRO_BATCH_SIZE."""
    return [d for d in divisors(per_replica) if d <= MAX_MICRO_BATCH_SIZE]


@dataclass(frozen=True)
class ProfileShapes:
    """The per-rank shapes a layer profile times for a search: every size the search may ask it for."""

    tp_sizes: tuple[int, ...]
    micro_batch_sizes: tuple[int, ...]
    cp_sizes: tuple[int, ...]


def profile_shapes(workload: Workload, world_size: int, gpus_per_node: int,
                   constraints: Mapping[str, Any] | None = None, *, allow_tp_across_nodes: bool = False,
                   gpus_per_domain: int | None = None, resume: ResumeRule | None = None) -> ProfileShapes:
    """The TP, micro-batch and CP sizes of the layouts enumerate_layouts may yield with the same
    arguments, by its own rules (its grids, micro-batch options and constraints), less the TP sizes
    no layout of this model can have (check_tensor_parallel_size): a profile of exactly these leaves
    the search nothing to extrapolate across sizes. Empty when no grid is valid."""
    constraints = {**(constraints or {}), **(resume.equalities if resume is not None else {})}
    tps, mbs, cps = set(), set(), set()
    for tp, cp, _, dp in _grids(workload, world_size, gpus_per_node, constraints, allow_tp_across_nodes,
                                gpus_per_domain, Rejections()):
        try:
            check_tensor_parallel_size(workload, tp)
        except Infeasible:
            continue
        tps.add(tp)
        cps.add(cp)
        mbs.update([constraints["micro_batch_size"]] if "micro_batch_size" in constraints
                   else micro_batch_options(workload.global_batch_size // dp))
    return ProfileShapes(tuple(sorted(tps)), tuple(sorted(mbs)), tuple(sorted(cps)))


def context_parallel_options(workload: Workload, ranks: int) -> list[int]:
    """Context-parallel sizes worth searching: each rank keeps at least CP_MIN_TOKENS of the sequence
    (fewer leave attention too little work to hide the key/value exchange behind)."""
    s = workload.seq_length
    return [cp for cp in divisors(ranks) if cp == 1 or (s % (2 * cp) == 0 and s // cp >= CP_MIN_TOKENS)]


def _expert_options(workload: Workload, tp: int, pp: int, world_size: int, choices,
                    constraints: Mapping[str, Any]) -> list[tuple[int, int | None]]:
    """(EP, ETP) pairs: every EP dividing the experts whose expert grid fills the world, with the expert
    tensor-parallel size Megatron defaults to (TP) and, under TP, 1 (whole experts per rank); typed
    ones whatever they divide, for the layout's rules to name what they break."""
    typed = "expert_model_parallel_size" in constraints or "expert_tensor_parallel_size" in constraints
    if workload.num_experts is None:     # Megatron refuses EP > 1 without experts and ignores the ETP size
        return [(choices("expert_model_parallel_size", [1])[0], None)]
    etps = choices("expert_tensor_parallel_size", [None, 1] if tp > 1 else [None])
    return [(ep, etp) for ep in choices("expert_model_parallel_size", divisors(workload.num_experts))
            for etp in etps if typed or world_size % (ep * pp * (tp if etp is None else etp)) == 0]


def _layouts_for_grid(workload, tp, pp, dp, constraints, choices, rejected, sizes, resume,
                      preferred) -> Iterator[Job]:
    per_replica = workload.global_batch_size // dp
    splits = _user_split(constraints) or _pipeline_splits(workload.num_layers, pp)
    recomputes = [(None, None, None), ("selective", None, None), ("full", "uniform", 1)]
    if any(k in constraints for k in RECOMPUTE_FLAGS):
        # --recompute-modules alone means selective recomputation of those modules.
        g = constraints.get("recompute_granularity", "selective" if "recompute_modules" in constraints else None)
        recomputes = [(g, constraints.get("recompute_method", "uniform" if g == "full" else None),
                       constraints.get("recompute_num_layers", 1 if g == "full" else None))]
    overlap = constraints.get("overlap_grad_reduce", dp > 1)
    for (first, last, counted), mbs, (rg, rm, rn), sp, dopt in product(
            splits,
            choices("micro_batch_size", micro_batch_options(per_replica)),
            recomputes,
            dict.fromkeys(megatron_sequence_parallel(tp, sp) for sp in choices("sequence_parallel", (True, False))),
            choices("use_distributed_optimizer", (True, False) if dp > 1 else (False,))):
        # --overlap-param-gather is not always faster: without interleaving every later stage
        # waits for its own all-gather along the pipeline fill (cost.timing).
        for gather in choices("overlap_param_gather", (True, False) if dopt and overlap else (False,)):
            base = Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
                          **sizes, micro_batch_size=mbs, sequence_parallel=sp, use_distributed_optimizer=dopt,
                          recompute_granularity=rg, recompute_method=rm, recompute_num_layers=rn,
                          **{k: constraints[k] for k in KEPT_AS_GIVEN if k in constraints},
                          decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
                          overlap_grad_reduce=overlap, overlap_param_gather=gather,
                          account_for_embedding_in_pipeline_split=constraints.get(
                              "account_for_embedding_in_pipeline_split", counted),
                          account_for_loss_in_pipeline_split=constraints.get("account_for_loss_in_pipeline_split",
                                                                             counted))
            if resume is not None and (why := resume.breaks(base)):
                rejected.add(Infeasible(f"the checkpoint to resume from: {why[0]}"))
                continue
            yield from _jobs(workload, base, constraints, rejected, preferred)


def _jobs(workload: Workload, base: Layout, constraints, rejected, preferred) -> Iterator[Job]:
    """The job of `base` with every interleaving option (interleaved only where the search itself
    counted the embedding and loss in the split), with the `preferred` settings where Megatron accepts
    them; rejections counted by kind."""
    virtual = _virtual_options(workload, base, constraints)
    if base.account_for_embedding_in_pipeline_split and not any(k in constraints for k in SPLIT_FLAGS):
        virtual = [lpv for lpv in virtual if lpv]
    # --overlap-param-gather-with-optimizer-step only where typed: Megatron 0.19 rejects it under
    # distributed checkpointing, its default --ckpt-format (and what --auto-parallel resumes from).
    step = constraints.get("overlap_param_gather_with_optimizer_step", False)
    for lpv in virtual:
        layout = replace(base, num_layers_per_virtual_pipeline_stage=lpv, overlap_param_gather_with_optimizer_step=step)
        if preferred:
            try:
                yield resolve_job(workload, replace(layout, **preferred))
                continue
            except Infeasible:
                pass                      # not valid here: the layout as it is, or its own rejection
        try:
            yield resolve_job(workload, layout)
        except Infeasible as e:
            rejected.add(e)


def _virtual_options(workload: Workload, layout: Layout, constraints) -> list[int | None]:
    if "num_layers_per_virtual_pipeline_stage" in constraints:
        return [constraints["num_layers_per_virtual_pipeline_stage"]]
    if "pipeline_model_parallel_layout" in constraints:     # the string sets the chunks
        return [None]
    if layout.pp == 1 or layout.decoder_first_pipeline_num_layers or layout.decoder_last_pipeline_num_layers:
        return [None]
    counted = (workload.num_layers + layout.account_for_embedding_in_pipeline_split
               + layout.account_for_loss_in_pipeline_split)      # the layers the split divides
    per_stage = counted // layout.pp
    return [None] + [d for d in divisors(per_stage) if d < per_stage]
