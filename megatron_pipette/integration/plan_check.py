"""Whether a plan document can run this job, before any rank applies it.

A plan comes from the cache, from --auto-parallel-plan-file, or was just made; a cached or pinned
one may be for another model, another allocation or other flags (a plan pinned for another
global batch once made every rank die in Megatron's validate_args). Checked here against what the
job asks: the model fields, the world size and the processes per node the placement permutes, the
layout rules Megatron applies (spec.job.resolve_job, and its evaluation batch rule), the flags typed
beside --auto-parallel and what the checkpoint to resume from fixes. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_pipette.errors import Infeasible, PipetteError
from megatron_pipette.plan.planner import MEMORY_HEADROOM
from megatron_pipette.plan.search import Rejections, enumerate_layouts
from megatron_pipette.report.plan_document import PlanRecord
from megatron_pipette.spec.cluster_file import ClusterFile
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import ProfileFile, check_profile_matches
from megatron_pipette.spec.layout import TRANSFORMER_ENGINE_ONLY, Layout, check_implementation
from megatron_pipette.spec.resume import ResumeRule
from megatron_pipette.spec.workload import Workload, megatron_flag


@dataclass(frozen=True, kw_only=True)
class JobRequest:
    """What this job asks of a plan."""

    workload: Workload
    world_size: int
    gpus_per_node: int
    """Processes per node: the placement permutes whole nodes of this size."""
    typed: Mapping[str, Any] = field(default_factory=dict)
    """Layout fields fixed by flags typed beside --auto-parallel, or by what this installation can run
    (megatron_args.constraints_from_args): part of the cache key."""
    checkpoint: ResumeRule | None = None
    """What the checkpoint to resume from fixes (spec.resume.resume_rule; None: no checkpoint): not
    part of the cache key, so a restart from a checkpoint finds the plan it was saved under."""
    nodes: tuple[str, ...] = ()
    """The host of each node, in rank order (the probe's names for them); (): not known."""
    device_name: str | None = None
    """What torch calls this job's devices ("cpu" in a rehearsal); None: not known."""
    transformer_engine: bool = True
    """Whether Megatron builds Transformer Engine's layers here (spec.layout.check_implementation)."""
    eval_global_batch_size: int | None = None
    """--eval-global-batch-size (None: Megatron's default, --global-batch-size)."""
    eval_micro_batch_size: int | None = None
    """--eval-micro-batch-size (None: Megatron's default, the plan's --micro-batch-size)."""
    memory_headroom: float = MEMORY_HEADROOM
    """--auto-parallel-memory-headroom, as a share: what a plan's pick leaves free (planner step 5)."""

    @property
    def constraints(self) -> dict[str, Any]:
        """Every field the search must keep at one value (the checkpoint's `breaks` says the rest)."""
        return {**self.typed, **(self.checkpoint.equalities if self.checkpoint is not None else {})}


def typed_problem(request: JobRequest) -> str | None:
    """Why no layout of this model on this many processes honours the flags typed beside --auto-parallel
    (`--tensor-model-parallel-size 3` on 4), by the search's own rules, in one line; None when one does.
    Asked before anything is probed: the flags as given cannot run either, so there is nothing to fall
    back to."""
    try:
        check_implementation(Layout(**{k: v for k, v in request.typed.items() if k in TRANSFORMER_ENGINE_ONLY}),
                             request.transformer_engine)
    except Infeasible as e:
        return str(e)
    rejected = Rejections()
    if not request.typed or next(iter(enumerate_layouts(request.workload, request.world_size, request.gpus_per_node,
                                                        request.typed, rejected=rejected)), None) is not None:
        return None
    typed = ", ".join(f"{megatron_flag(name)} {value}" for name, value in sorted(request.typed.items()))
    reasons = "; ".join(list(rejected.examples.values())[:3]) or "none is valid"
    return (f"no layout of this model on {request.world_size} processes honours the layout flags fixed here "
            f"({typed}): {reasons}")


def measured_problem(request: JobRequest, probed: ClusterFile | None = None,
                     profiled: ProfileFile | None = None) -> str | None:
    """Why a cached probe (or layer profile) is not of this job: a probe of another allocation (its
    size, hosts or devices), a profile of another model (the CLI's check_profile_matches) or device;
    None when it is."""
    if probed is not None:
        cluster = probed.cluster
        if (cluster.num_nodes, cluster.gpus_per_node) != (request.world_size // request.gpus_per_node,
                                                          request.gpus_per_node):
            return (f"it measured {cluster.num_nodes} node(s) of {cluster.gpus_per_node} devices, this job has "
                    f"{request.world_size // request.gpus_per_node} of {request.gpus_per_node}")
        if request.nodes and cluster.hosts != request.nodes:
            return f"it measured the hosts {', '.join(cluster.hosts)}, not this job's {', '.join(request.nodes)}"
        if request.device_name is not None and probed.device_name not in (None, request.device_name):
            return f"it measured {probed.device_name} devices, this job's are {request.device_name}"
    if profiled is not None:
        profile = profiled.profile
        try:
            check_profile_matches(profile, request.workload, where="it")
        except PipetteError as e:
            return str(e).removeprefix("it: ")
        if request.device_name is not None and profile.device_name != request.device_name:
            return f"it timed {profile.device_name}, this job's devices are {request.device_name}"
    return None


def _model_fields(workload: Workload) -> dict[str, Any]:
    """The workload as a plan document holds it (JSON turns tuples into lists); its name is a label."""
    fields = json.loads(json.dumps(asdict(workload)))
    fields.pop("name")
    return fields


def _same(planned: Any, wanted: Any) -> bool:
    norm = (lambda v: list(v) if isinstance(v, tuple) else v)
    return norm(planned) == norm(wanted)


def plan_problems(plan: PlanRecord, request: JobRequest) -> list[str]:
    """Why the plan cannot run this job, one reason each ([] when it can)."""
    layout, placement = plan.best.layout, plan.best.placement
    problems = []
    model, wanted = _model_fields(plan.model), _model_fields(request.workload)
    differ = sorted(k for k in wanted if model[k] != wanted[k])
    for k in differ[:4]:
        name = "precision" if k == "precision" else megatron_flag(k)
        problems.append(f"{name} {model[k]} in the plan, {wanted[k]} here")
    if len(differ) > 4:
        problems.append(f"{len(differ) - 4} more model field(s) differ")
    nodes, gpn = len(placement.node_order), placement.gpus_per_node
    if nodes * gpn != request.world_size or gpn != request.gpus_per_node:
        problems.append(f"the plan is for {nodes} node(s) of {gpn} processes, this job has "
                        f"{request.world_size // request.gpus_per_node} of {request.gpus_per_node}")
    elif not placement.is_permutation:
        problems.append(f"the plan's node order {list(placement.node_order)} is not an order of its {nodes} nodes")
    kept = request.checkpoint.equalities if request.checkpoint is not None else {}
    for name, value in sorted(request.constraints.items()):
        if not _same(getattr(layout, name), value):
            problems.append(f"{megatron_flag(name)} is {getattr(layout, name)} in the plan, {value} fixed here"
                            + (" by the checkpoint" if name in kept else ""))
    if request.checkpoint is not None:
        problems += [f"it cannot load the checkpoint: {why}" for why in request.checkpoint.breaks(layout)]
    if problems:    # the rules below are for this job's model and size
        return problems
    try:
        resolve_job(request.workload, layout, request.world_size)
        check_implementation(layout, request.transformer_engine)
    except (Infeasible, PipetteError) as e:
        return [f"Megatron would reject its layout: {e}"]
    eval_batch = request.eval_global_batch_size or request.workload.global_batch_size
    eval_micro = request.eval_micro_batch_size or layout.micro_batch_size
    if eval_batch % (eval_micro * layout.dp):
        problems.append(f"Megatron would reject its layout: --eval-global-batch-size {eval_batch} is not divisible "
                        f"by --eval-micro-batch-size {eval_micro} x data-parallel size {layout.dp}")
    return problems


def unresumable(request: JobRequest, where: str) -> str | None:
    """Why no layout of this job can load the checkpoint in `where`, with what to do, in one line; None
    when one can, or when none is valid whatever the checkpoint (planning then says why)."""
    rule = request.checkpoint
    if rule is None or not rule.binds:
        return None

    def any_layout(resume: ResumeRule | None) -> bool:
        return next(iter(enumerate_layouts(request.workload, request.world_size, request.gpus_per_node,
                                           request.typed, resume=resume)), None) is not None

    if any_layout(rule) or not any_layout(None):
        return None
    saved = rule.saved
    return (f"the checkpoint in {where}, saved under {saved.describe()} on {saved.world_size} processes, keeps "
            f"{rule.describe()}, which no layout of this model on {request.world_size} processes has (with the "
            f"flags typed); megatron-core 0.19 cannot load it otherwise: resume on {saved.world_size} processes "
            "(or a count where such a layout exists), or add --no-load-optim to resume its weights with a fresh "
            "optimizer")
