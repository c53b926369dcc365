"""`pipette`: plan, estimate and show, without a cluster.

    pipette plan                                   # built-in default: GPT-3 13B on 4 DGX A100 nodes
    pipette plan --model gpt3-175b --cluster dgx-a100 --num-nodes 128
    pipette estimate --model gpt3-175b --num-nodes 128 \\
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
    pipette show cluster.json --heatmap links.png
    pipette probe-sim --truth truth.json --world-size 8192 --gpus-per-node 8 --budget-s 30 --out probed.json
    pipette estimate --cluster truth.json --plan plan.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time as time_module

from megatron_pipette import __version__
from megatron_pipette.cli import render
from megatron_pipette.cli.args import (DEFAULT_MODEL, add_cluster_flags, add_layout_flags, add_workload_flags,
                                       check_megatron_flags, cluster_from_args, layout_constraints,
                                       profile_from_args, read_json, split_megatron_flags, workload_from_args)
from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import Infeasible, PipetteError
from megatron_pipette.files import write_cluster_file
from megatron_pipette.plan.document import chosen_from_json, estimate_json, plan_json
from megatron_pipette.plan.planner import evaluate, misfit_advice, plan
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout, check_user_layout
from megatron_pipette.spec.workload import Workload, megatron_flag, workload_fields

EXIT_USAGE = 2
EXIT_NOTHING_FITS = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipette", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--version", action="version", version=f"megatron-pipette {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="search every layout and rank placement; print the best")
    add_workload_flags(p)
    add_cluster_flags(p)
    add_layout_flags(p, "layout constraints (a flag given here is fixed; the rest is searched)")
    p.add_argument("--top", type=int, default=10, help="candidates to list (default 10)")
    p.add_argument("--allow-tp-across-nodes", action="store_true", help="let tensor parallel span nodes")
    p.add_argument("--json", action="store_true", help="print the plan document (candidates best first)")

    e = sub.add_parser("estimate", help="predict time and per-stage memory of one layout")
    add_workload_flags(e)
    add_cluster_flags(e)
    add_layout_flags(e, "layout (Megatron flags; data-parallel size = GPUs / (TP * PP))")
    e.add_argument("--plan", metavar="PLAN_JSON",
                   help="price this plan's model, layout and placement (from `plan --json` or a job's "
                        "pipette_plan.json) on --cluster instead of the flags")
    e.add_argument("--json", action="store_true", help="print the estimate as JSON")

    t = sub.add_parser("probe-sim", help="run the probe's logic on a simulated cluster (the probe twin)")
    t.add_argument("--truth", required=True, metavar="CLUSTER_JSON",
                   help="the cluster to simulate (schema version 1 or 2): its links price every message")
    t.add_argument("--world-size", type=int, required=True, help="ranks to simulate (must match the truth)")
    t.add_argument("--gpus-per-node", type=int, required=True, help="ranks per node (must match the truth)")
    t.add_argument("--budget-s", type=float, default=30.0, help="the probe's time budget (default 30)")
    t.add_argument("--seed", type=int, default=0, help="seed of the timing noise (default 0)")
    t.add_argument("--noise", type=float, default=0.0,
                   help="sigma of a lognormal factor on every simulated timing (default 0: exact)")
    t.add_argument("--small-bytes", type=int, default=4096, help="latency message size (default 4096)")
    t.add_argument("--large-bytes", type=int, default=64 << 20, help="bandwidth message size (default 64 MiB)")
    t.add_argument("--repeats", type=int, default=3, help="timed repeats per size and pair (default 3)")
    t.add_argument("--out", required=True, help="the cluster file the probe would write")

    s = sub.add_parser("show", help="summarise a probed cluster file; optionally draw its link heatmap")
    s.add_argument("file", help="cluster JSON written by the probe")
    s.add_argument("--heatmap", metavar="PNG", help="write the bandwidth matrix as a heatmap")
    return parser


def cmd_plan(ns: argparse.Namespace) -> int:
    workload = workload_from_args(ns, DEFAULT_MODEL)
    cluster = cluster_from_args(ns, workload.precision)
    profile = profile_from_args(ns, workload, cluster)
    if ns.top <= 0:
        raise PipetteError(f"--top must be a positive integer, got {ns.top}")
    constraints = layout_constraints(ns)
    check_user_layout(Layout(**constraints))
    result = plan(workload, CostModel(cluster, profile=profile), constraints=constraints, top_k=ns.top,
                  allow_tp_across_nodes=ns.allow_tp_across_nodes)
    if ns.json:
        print(json.dumps(plan_json(result), indent=1))
    if not result.candidates:
        print(f"pipette: nothing fits: none of the {result.considered} valid layouts of {workload.name} fits "
              f"in {cluster.memory_bytes / 2**30:.1f} GiB per GPU on {cluster.world_size} GPUs.", file=sys.stderr)
        for line in [*misfit_advice(workload, cluster, result), *render.rejections(result)]:
            print(f"  {line}", file=sys.stderr)
        return EXIT_NOTHING_FITS
    if not ns.json:
        print(render.plan_report(result))
    return 0


def cmd_estimate(ns: argparse.Namespace) -> int:
    if ns.plan is not None:
        return estimate_plan(ns)
    workload = workload_from_args(ns, DEFAULT_MODEL)
    cluster = cluster_from_args(ns, workload.precision)
    profile = profile_from_args(ns, workload, cluster)
    fields = layout_constraints(ns)
    tp = fields.get("tensor_model_parallel_size", 1)
    pp = fields.get("pipeline_model_parallel_size", 1)
    check_user_layout(Layout(**fields))
    if cluster.world_size % (tp * pp):
        raise PipetteError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} does not "
                           f"divide the {cluster.world_size} GPUs")
    layout = Layout(**fields, data_parallel_size=cluster.world_size // (tp * pp))
    try:
        job = resolve_job(workload, layout, cluster.world_size)
    except Infeasible as e:
        raise PipetteError(f"Megatron would reject this layout: {e}") from None
    time, memory = evaluate(CostModel(cluster, profile=profile), job)
    if ns.json:
        print(json.dumps({**estimate_json(layout, time, memory), "cluster": cluster.name}, indent=1))
    else:
        print(render.estimate_report(layout.describe(), time, memory))
    return 0


def estimate_plan(ns: argparse.Namespace) -> int:
    """`estimate --plan`: a plan made on one cluster (say, a probed one), priced on another."""
    typed = [megatron_flag(f.name) for f in workload_fields() if hasattr(ns, f.name)] + \
        [megatron_flag(name) for name in layout_constraints(ns)] + (["--model"] if hasattr(ns, "model") else [])
    if typed:
        raise PipetteError(f"--plan gives the model and the layout; drop {', '.join(typed)}")
    doc = read_json(ns.plan, "--plan")
    layout, placement = chosen_from_json(doc, where=f"--plan {ns.plan}")
    try:
        workload = Workload(**doc["model"])
    except (KeyError, TypeError) as e:
        raise PipetteError(f"--plan {ns.plan}: malformed model ({e!r})") from None
    cluster = cluster_from_args(ns, workload.precision)
    if placement.logical_to_physical.size != cluster.world_size or placement.gpus_per_node != cluster.gpus_per_node:
        raise PipetteError(f"--plan {ns.plan} places {len(placement.node_order)} nodes of "
                           f"{placement.gpus_per_node}; --cluster has {cluster.num_nodes} of {cluster.gpus_per_node}")
    profile = profile_from_args(ns, workload, cluster)
    try:
        job = resolve_job(workload, layout, cluster.world_size)
    except Infeasible as e:
        raise PipetteError(f"--plan {ns.plan}: Megatron would reject its layout: {e}") from None
    time, memory = evaluate(CostModel(cluster, profile=profile), job, placement)
    if ns.json:
        print(json.dumps({**estimate_json(layout, time, memory), "cluster": cluster.name,
                          "placement": {"node_order": list(placement.node_order)}}, indent=1))
    else:
        print(render.estimate_report(f"{layout.describe()} placed on nodes {render.node_order(placement)}",
                                     time, memory))
    return 0


def cmd_probe_sim(ns: argparse.Namespace) -> int:
    from megatron_pipette.probe.options import check_args, out_problem
    from megatron_pipette.probe.schedule import node_pairs_met
    from megatron_pipette.probe.twin import compare_to_truth, run_twin
    from megatron_pipette.spec.cluster_file import cluster_from_json

    check_args(ns.budget_s, "bf16", ns.small_bytes, ns.large_bytes, ns.repeats)
    if not ns.noise >= 0:
        raise PipetteError(f"--noise must be >= 0, got {ns.noise}")
    if problem := out_problem(ns.out):
        raise PipetteError(problem)
    truth = cluster_from_json(read_json(ns.truth, "--truth"), where=f"--truth {ns.truth}")
    if (ns.world_size, ns.gpus_per_node) != (truth.world_size, truth.gpus_per_node):
        raise PipetteError(f"--world-size {ns.world_size} --gpus-per-node {ns.gpus_per_node} do not match "
                           f"--truth {ns.truth} ({truth.num_nodes} nodes x {truth.gpus_per_node} = "
                           f"{truth.world_size} GPUs)")
    started = time_module.perf_counter()
    doc, simulated_s = run_twin(truth, budget_s=ns.budget_s, small_bytes=ns.small_bytes,
                                large_bytes=ns.large_bytes, repeats=ns.repeats, noise=ns.noise, seed=ns.seed)
    probed = cluster_from_json(doc, where="probe-sim")
    write_cluster_file(doc, ns.out)
    wall_s = time_module.perf_counter() - started
    p = doc["probe"]
    errors = compare_to_truth(probed, truth, node_pairs_met(truth.num_nodes, truth.gpus_per_node,
                                                            p["inter_rounds_measured"]))
    print(render.twin_report(doc, simulated_s, wall_s, errors))
    print(f"wrote {ns.out}")
    return 0


def cmd_show(ns: argparse.Namespace) -> int:
    from megatron_pipette.report.cluster_report import summarize, write_heatmap
    from megatron_pipette.spec.cluster_file import cluster_from_json

    doc = read_json(ns.file, "show")
    cluster_from_json(doc, where=ns.file)  # the same validation `plan --cluster` applies
    print(summarize(doc))
    if ns.heatmap:
        write_heatmap(doc, ns.heatmap)
        print(f"heatmap written to {ns.heatmap}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, leftovers = parser.parse_known_args(argv)
    megatron, unknown = (split_megatron_flags(leftovers) if ns.command in ("plan", "estimate")
                         else ({}, leftovers))
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        check_megatron_flags(megatron)
        return {"plan": cmd_plan, "estimate": cmd_estimate, "show": cmd_show,
                "probe-sim": cmd_probe_sim}[ns.command](ns)
    except PipetteError as e:
        print(f"pipette {ns.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
