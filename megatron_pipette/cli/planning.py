"""`pipette plan` and `pipette estimate`: the planner on a preset or a measured cluster."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TextIO

from megatron_pipette.cli.args import (
    DEFAULT_MODEL,
    add_cluster_flags,
    add_layout_flags,
    add_workload_flags,
    cluster_from_args,
    layout_constraints,
    precision_note,
    profile_from_args,
    transformer_engine_layers,
    workload_from_args,
)
from megatron_pipette.cost.memory import environment_overheads
from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import Infeasible, PipetteError
from megatron_pipette.files import read_json
from megatron_pipette.plan.placement import Placement
from megatron_pipette.plan.planner import HEADROOM_TIME, MEMORY_HEADROOM, evaluate, misfit_advice, plan
from megatron_pipette.probe.options import out_problem
from megatron_pipette.report import plans
from megatron_pipette.report.plan_document import PlanRecord, estimate_json, plan_json
from megatron_pipette.spec.hardware import Cluster
from megatron_pipette.spec.job import Job, resolve_job
from megatron_pipette.spec.layer_profile import LayerProfile
from megatron_pipette.spec.layout import (
    Layout,
    check_implementation,
    check_user_layout,
    megatron_sequence_parallel,
)
from megatron_pipette.spec.workload import megatron_flag, workload_fields
from megatron_pipette.units import GiB

EXIT_NOTHING_FITS = 3


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="search every layout and rank placement; print the best")
    add_workload_flags(p)
    add_cluster_flags(p)
    add_layout_flags(p, "layout constraints (a flag given here is fixed; the rest is searched)")
    p.add_argument("--top", type=int, default=10, help="candidates to list (default 10)")
    p.add_argument("--allow-tp-across-nodes", action="store_true", help="let tensor parallel span nodes")
    p.add_argument("--memory-headroom", type=float, default=100 * MEMORY_HEADROOM, metavar="PCT",
                   help="leave PCT%% of device memory free: a layout that leaves less is passed over for one that "
                        f"leaves it within {100 * HEADROOM_TIME:g}%% of its time (if none does, the fastest that "
                        f"fits) (default {100 * MEMORY_HEADROOM:g})")
    p.add_argument("--json", action="store_true", help="print the plan document (candidates best first)")
    p.add_argument("--timeline", metavar="PNG",
                   help="draw one iteration of the best layout's pipeline schedule (the simulator's events)")
    p.set_defaults(run=cmd_plan)


def add_estimate_parser(sub) -> None:
    e = sub.add_parser("estimate", help="predict time and per-stage memory of one layout")
    add_workload_flags(e)
    add_cluster_flags(e)
    add_layout_flags(e, "layout (Megatron flags; data-parallel size = GPUs / (TP * PP))")
    e.add_argument("--plan", metavar="PLAN_JSON",
                   help="price this plan's model, layout and placement (from `plan --json` or a job's "
                        "pipette_plan.json) on --cluster instead of the flags")
    e.add_argument("--json", action="store_true", help="print the estimate as JSON")
    e.set_defaults(run=cmd_estimate)


def cmd_plan(ns: argparse.Namespace) -> int:
    workload = workload_from_args(ns, DEFAULT_MODEL)
    cluster = cluster_from_args(ns, workload.precision)
    profile = profile_from_args(ns, workload, cluster)
    if ns.top <= 0:
        raise PipetteError(f"--top must be a positive integer, got {ns.top}")
    if not 0 <= ns.memory_headroom < 100:
        raise PipetteError(f"--memory-headroom must be a percentage of 0 or more and under 100, got "
                           f"{ns.memory_headroom:g}")
    check_picture_path(ns.timeline, "--timeline")
    constraints = _as_megatron_runs(ns, layout_constraints(ns, workload.num_layers))
    check_user_layout(Layout(**constraints))
    try:
        check_implementation(Layout(**constraints), transformer_engine_layers(ns))
    except Infeasible as e:
        raise PipetteError(f"Megatron would reject this layout: {e}") from None
    model = _cost_model(cluster, profile)
    result = plan(workload, model, constraints=constraints, top_k=ns.top,
                  allow_tp_across_nodes=ns.allow_tp_across_nodes, memory_headroom=ns.memory_headroom / 100)
    if ns.json:
        print(json.dumps(plan_json(result), indent=1))
    if not result.considered:
        print(f"pipette plan: {plans.no_valid_layout(result)}", file=sys.stderr)
        return EXIT_NOTHING_FITS
    if not result.candidates:
        print(f"pipette: nothing fits: none of the {result.considered} valid layouts of {workload.name} fits "
              f"in {cluster.memory_bytes / GiB:.1f} GiB per GPU on {cluster.world_size} GPUs.", file=sys.stderr)
        for line in [*misfit_advice(workload, cluster, result), *plans.rejections(result)]:
            print(f"  {line}", file=sys.stderr)
        return EXIT_NOTHING_FITS
    if not ns.json:
        print(plans.plan_report(result, precision_note(ns, workload), constraints))
    if ns.timeline:
        best = result.candidates[0]
        job = resolve_job(workload, best.layout, cluster.world_size)
        draw_timeline(model, job, best.placement, ns.timeline, f"{workload.name} on {cluster.name}: "
                      f"{best.layout.describe()}", sys.stderr if ns.json else sys.stdout)
    return 0


def _as_megatron_runs(ns: argparse.Namespace, typed: dict) -> dict:
    """The typed layout flags as Megatron runs them (spec.layout.megatron_sequence_parallel: no
    --sequence-parallel at TP 1); one line says what changed (on stderr beside --json)."""
    sequence_parallel = typed.get("sequence_parallel", False)
    if megatron_sequence_parallel(typed.get("tensor_model_parallel_size", 1), sequence_parallel) == sequence_parallel:
        return typed
    print("--sequence-parallel with --tensor-model-parallel-size 1: priced without it, as Megatron turns "
          "sequence parallelism off at TP 1", file=sys.stderr if ns.json else sys.stdout)
    return {**typed, "sequence_parallel": False}


def _cost_model(cluster: Cluster, profile: LayerProfile | None) -> CostModel:
    """The cost model of `cluster`, with the memory overheads of this shell's environment (the job's,
    when pipette runs in its launch script: PYTORCH_CUDA_ALLOC_CONF)."""
    return CostModel(cluster, profile=profile, overheads=environment_overheads(os.environ))


def check_picture_path(path: str | None, flag: str) -> None:
    """Refuse a picture path that cannot be written, before the work that draws it."""
    if problem := out_problem(path, flag):
        raise PipetteError(problem)


def draw_timeline(model: CostModel, job: Job, placement: Placement, path: str, title: str, out: TextIO) -> None:
    from megatron_pipette.report.timeline import write_timeline

    write_timeline(model.timeline(job, placement.logical_to_physical), path, title)
    print(f"timeline written to {path}", file=out)


def cmd_estimate(ns: argparse.Namespace) -> int:
    if ns.plan is not None:
        return estimate_plan(ns)
    workload = workload_from_args(ns, DEFAULT_MODEL)
    cluster = cluster_from_args(ns, workload.precision)
    profile = profile_from_args(ns, workload, cluster)
    fields = _as_megatron_runs(ns, layout_constraints(ns, workload.num_layers))
    tp = fields.get("tensor_model_parallel_size", 1)
    pp = fields.get("pipeline_model_parallel_size", 1)
    cp = fields.get("context_parallel_size", 1)
    check_user_layout(Layout(**fields))
    if cluster.world_size % (tp * pp * cp):
        raise PipetteError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x "
                           f"--context-parallel-size {cp} does not divide the {cluster.world_size} GPUs")
    layout = Layout(**fields, data_parallel_size=cluster.world_size // (tp * pp * cp))
    try:
        job = resolve_job(workload, layout, cluster.world_size)
        check_implementation(layout, transformer_engine_layers(ns))
    except Infeasible as e:
        raise PipetteError(f"Megatron would reject this layout: {e}") from None
    time, memory = evaluate(_cost_model(cluster, profile), job)
    if ns.json:
        print(json.dumps({**estimate_json(layout, time, memory), "cluster": cluster.name}, indent=1))
    else:
        print(plans.estimate_report(f"{layout.describe()} in {plans.precision_priced(workload)}"
                                     f"{precision_note(ns, workload)}", time, memory))
    return 0


def _plan_on_cluster(ns: argparse.Namespace) -> tuple[Job, Placement, CostModel]:
    """The job and placement of the plan --plan names, and the cost model of --cluster to price them."""
    typed = [megatron_flag(f.name) for f in workload_fields() if hasattr(ns, f.name)] + \
        [megatron_flag(name) for name in layout_constraints(ns)] + (["--model"] if hasattr(ns, "model") else [])
    if typed:
        raise PipetteError(f"--plan gives the model and the layout; drop {', '.join(typed)}")
    pinned = PlanRecord.from_json(read_json(ns.plan, "--plan"), where=f"--plan {ns.plan}")
    layout, placement = pinned.best.layout, pinned.best.placement
    workload = pinned.model
    cluster = cluster_from_args(ns, workload.precision)
    nodes = len(placement.node_order)
    if nodes * placement.gpus_per_node != cluster.world_size or placement.gpus_per_node != cluster.gpus_per_node:
        raise PipetteError(f"--plan {ns.plan} places {nodes} nodes of "
                           f"{placement.gpus_per_node}; --cluster has {cluster.num_nodes} of {cluster.gpus_per_node}")
    if not placement.is_permutation:
        raise PipetteError(f"--plan {ns.plan}: its node order {list(placement.node_order)} is not an order of its "
                           f"{nodes} nodes")
    profile = profile_from_args(ns, workload, cluster)
    try:
        job = resolve_job(workload, layout, cluster.world_size)
        check_implementation(layout, transformer_engine_layers(ns))
    except Infeasible as e:
        raise PipetteError(f"--plan {ns.plan}: Megatron would reject its layout: {e}") from None
    return job, placement, _cost_model(cluster, profile)


def _placed(job: Job, placement: Placement) -> str:
    return (f"{job.layout.describe()} in {plans.precision_priced(job.workload)} placed on nodes "
            f"{plans.node_order(placement)}")


def estimate_plan(ns: argparse.Namespace) -> int:
    """`estimate --plan`: a plan made on one cluster (say, a probed one), priced on another."""
    job, placement, model = _plan_on_cluster(ns)
    time, memory = evaluate(model, job, placement)
    if ns.json:
        print(json.dumps({**estimate_json(job.layout, time, memory), "cluster": model.cluster.name,
                          "placement": {"node_order": list(placement.node_order)}}, indent=1))
    else:
        print(plans.estimate_report(_placed(job, placement), time, memory))
    return 0


def show_plan(ns: argparse.Namespace) -> None:
    """`show --plan`: the plan's estimate on --cluster and, with --timeline, the picture of its iteration."""
    check_picture_path(ns.timeline, "--timeline")
    job, placement, model = _plan_on_cluster(ns)
    print(plans.estimate_report(_placed(job, placement), *evaluate(model, job, placement)))
    if ns.timeline:
        draw_timeline(model, job, placement, ns.timeline, f"{job.workload.name} on {model.cluster.name}: "
                      f"{job.layout.describe()}", sys.stdout)
