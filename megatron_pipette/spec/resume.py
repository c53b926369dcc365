"""What a checkpoint fixes of the layout that resumes it, under megatron-core 0.19.2.

A `torch_dist` checkpoint stores every model tensor under a key and global offsets of its own
(sharded_state_dict), so TP, PP, VP, DP, CP, EP, ETP and the pipeline split reshard on load. Its
optimizer state does not reshard everything: its structure follows choices of the layout that saved
it. `resume_rule` says which of them a resume must keep (the list, with megatron-core's lines, is
its docstring and docs/elastic.md): fields kept at the saved value (`ResumeRule.equalities`,
constraints like typed flags) and a predicate beyond them (`ResumeRule.breaks`: EP > 1 or
ETP != TP is not one value).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import megatron_flag

FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space")
"""Distributed-optimizer sharding types that reshard in TP and PP
(DistributedOptimizer.checkpoint_fully_reshardable_formats); the others are the optimizer's buffers."""
BUFFER_SHAPING = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                  "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
                  "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                  "expert_model_parallel_size", "expert_tensor_parallel_size")
"""What shapes the distributed optimizer's buffers per model-parallel rank, kept under dp_reshardable."""


def expert_optimizer(layout: Layout, moe: bool) -> bool:
    """Whether expert parameters get an optimizer of their own: MoE under EP > 1 or ETP != TP
    (megatron-core's `use_expert_pgs`, tensor_parallel/layers.py:961-963)."""
    return moe and (layout.ep > 1 or layout.etp != layout.tp)


@dataclass(frozen=True, kw_only=True)
class ResumeRule:
    """What a resume must keep of the layout its checkpoint was saved under; None: not bound."""

    saved: Layout
    """The layout the checkpoint was saved under (its own arguments)."""
    moe: bool = False
    use_distributed_optimizer: bool | None = None
    """--use-distributed-optimizer, kept while the optimizer state is loaded."""
    expert_optimizer: bool | None = None
    """Expert parameters in an optimizer of their own (EP > 1 or ETP != TP), kept likewise."""
    fixed: tuple[str, ...] = field(default_factory=tuple)
    """Layout fields kept as saved (a dp_reshardable distributed-optimizer state: BUFFER_SHAPING)."""

    @property
    def equalities(self) -> dict:
        """The fields kept at one value, as the search's constraints."""
        kept = {name: getattr(self.saved, name) for name in self.fixed if name != "expert_tensor_parallel_size"}
        if self.use_distributed_optimizer is not None:
            kept["use_distributed_optimizer"] = self.use_distributed_optimizer
        return kept

    def breaks(self, layout: Layout) -> list[str]:
        """Why `layout`, which keeps the `equalities` (constraints of the search and the plan check),
        cannot load the checkpoint, one reason each ([] when it can)."""
        why = []
        if "expert_tensor_parallel_size" in self.fixed and layout.etp != self.saved.etp:   # None is TP's size
            why.append(f"--expert-tensor-parallel-size is {layout.etp}, the checkpoint's {self.saved.etp}")
        if self.expert_optimizer is not None and expert_optimizer(layout, self.moe) != self.expert_optimizer:
            why.append(("its expert parameters have an optimizer of their own, which megatron-core gives them only "
                        "under EP > 1 or ETP != TP" if self.expert_optimizer else
                        "its expert parameters share the dense optimizer, which megatron-core has only under EP 1 "
                        "and ETP = TP") + f"; {layout.describe()} has " + _experts(not self.expert_optimizer))
        return why

    def unkept(self, layout: Layout) -> list[str]:
        """Everything of the rule `layout` does not keep, the equalities included (a layout the search
        did not make: the user's own flags)."""
        return [f"{megatron_flag(name)} is {getattr(layout, name)}, the checkpoint's {value}"
                for name, value in self.equalities.items() if getattr(layout, name) != value] + self.breaks(layout)

    def describe(self) -> str:
        """What it keeps, in one clause ("nothing": the optimizer state is not loaded)."""
        kept = [f"{megatron_flag(k)} {v}" for k, v in self.equalities.items()]
        if "expert_tensor_parallel_size" in self.fixed:
            kept.append(f"--expert-tensor-parallel-size {self.saved.etp}")
        if self.expert_optimizer is not None:
            kept.append(_experts(self.expert_optimizer))
        return ", ".join(kept) or "nothing"

    @property
    def binds(self) -> bool:
        """Whether it keeps anything."""
        return bool(self.equalities) or self.expert_optimizer is not None


def _experts(own_optimizer: bool) -> str:
    return "EP > 1 or ETP != TP" if own_optimizer else "EP 1 and ETP = TP"


def resume_rule(saved: Layout, *, moe: bool, loads_optimizer: bool, optimizer_sharding: str | None) -> ResumeRule:
    """What a resume keeps of `saved`, the layout a torch_dist checkpoint was saved under (of a model
    with experts: `moe`), where the job `loads_optimizer` state from it, saved as `optimizer_sharding`
    (the distributed optimizer's sharding type, as Megatron resolves it), as megatron-core 0.19.2
    loads it (paths under megatron/):

    * Nothing when the optimizer state is not loaded (--no-load-optim, --finetune, a checkpoint saved
      with --no-save-optim, a release checkpoint: training/checkpointing.py:2205-2213): model tensors
      carry global keys and offsets and reshard in every dimension.
    * --use-distributed-optimizer: the distributed optimizer saves `param_state` and its sharding type
      (core/optimizer/distrib_optimizer.py:1460-1580), the others `fp32_from_fp16_params` beside the
      torch optimizer's own (core/optimizer/optimizer.py:1132-1190); the load builds the current one's
      structure (training/checkpointing.py:2217) and fails on the other's (KeyError 'optimizer').
    * MoE: whether expert parameters have an optimizer of their own, EP > 1 or ETP != TP. Expert
      linear layers mark their parameters allreduce=False only then (core/tensor_parallel/layers.py:
      948, 961-963, 1017, 1379-1383; Transformer Engine's: core/extensions/transformer_engine.py:
      981-984, 1477, 1733), which makes them `is_expert_parallel` (core/optimizer/__init__.py:348)
      and puts them in a second, chained optimizer (core/optimizer/__init__.py:1181-1216). Across the
      two, ChainedOptimizer.load_state_dict raises "Expected 2 entries in state dict, but got 4"
      (core/optimizer/optimizer.py:1573-1581), and the parameter groups, keyed by is_expert_parallel
      (core/optimizer/optimizer.py:139-148), "Could not find parameter group with key"
      (core/optimizer/optimizer.py:638-644). Between EP 2 and EP 4, or ETP 1 and 2 under EP > 1,
      both sides have the second optimizer, and fully reshardable state reshards.
    * Under a distributed optimizer saved dp_reshardable (Megatron's default, where
      --dist-ckpt-optim-fully-reshardable is off: training/checkpointing.py:499-505), TP and PP:
      Megatron refuses to change them (training/checkpointing.py:2246-2254); the state is the
      optimizer's buffers per model-parallel rank, so what shapes them (BUFFER_SHAPING) is kept too.
      --auto-parallel saves fully reshardable state, which reshards.

    Not kept, since megatron-core does not fix them: the RNG state and the rerun state machine are
    ignored after a TP, PP or DP change (training/checkpointing.py:2171-2193, 2287-2300), VP and the
    pipeline split (model keys are global layer numbers), CP, sequence parallelism (the norms' weights
    are replicated either way). --overlap-param-gather-with-optimizer-step would split the dense
    optimizer in two (core/optimizer/__init__.py:1049-1051), but Megatron refuses it with torch_dist
    checkpoints and the search never chooses it. FP8 parameters (--fp8-param-gather) need Transformer
    Engine and were not read."""
    if not loads_optimizer:
        return ResumeRule(saved=saved, moe=moe)
    dopt = saved.use_distributed_optimizer
    fixed = BUFFER_SHAPING if dopt and optimizer_sharding not in FULLY_RESHARDABLE else ()
    return ResumeRule(saved=saved, moe=moe, use_distributed_optimizer=dopt,
                      expert_optimizer=expert_optimizer(saved, moe) if moe else None, fixed=fixed)
