"""`pipette`: plan, estimate and show, without a cluster.

    pipette plan                                   # built-in default: GPT-3 13B on 4 DGX A100 nodes
    pipette plan --model gpt3-175b --cluster dgx-a100 --num-nodes 128
    pipette estimate --model gpt3-175b --num-nodes 128 \\
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
    pipette show cluster.json --heatmap links.png
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_pipette import __version__
from megatron_pipette.cli import render
from megatron_pipette.cli.args import (DEFAULT_MODEL, add_cluster_flags, add_layout_flags, add_workload_flags,
                                       check_megatron_flags, cluster_from_args, layout_constraints,
                                       profile_from_args, read_json, split_megatron_flags, workload_from_args)
from megatron_pipette.errors import Infeasible, PipetteError
from megatron_pipette.plan.document import estimate_json, plan_json
from megatron_pipette.plan.planner import evaluate, misfit_advice, plan
from megatron_pipette.spec.layout import Layout, check_user_layout, validate_layout

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
    e.add_argument("--json", action="store_true", help="print the estimate as JSON")

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
    result = plan(workload, cluster, profile=profile, constraints=constraints, top_k=ns.top,
                  allow_tp_across_nodes=ns.allow_tp_across_nodes)
    if ns.json:
        print(json.dumps(plan_json(result), indent=1))
    if not result.candidates:
        print(f"pipette: nothing fits: none of the {result.considered} valid layouts of {workload.name} fits "
              f"in {cluster.memory_bytes / 2**30:.1f} GiB per GPU on {cluster.world_size} GPUs.", file=sys.stderr)
        for line in misfit_advice(workload, cluster, result):
            print(f"  {line}", file=sys.stderr)
        return EXIT_NOTHING_FITS
    if not ns.json:
        print(render.plan_report(result))
    return 0


def cmd_estimate(ns: argparse.Namespace) -> int:
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
        validate_layout(workload, layout, cluster.world_size)
    except Infeasible as e:
        raise PipetteError(f"Megatron would reject this layout: {e}") from None
    time, memory = evaluate(workload, layout, cluster, profile=profile)
    if ns.json:
        print(json.dumps({**estimate_json(layout, time, memory), "cluster": cluster.name}, indent=1))
    else:
        print(render.estimate_report(layout.describe(), time, memory))
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
    megatron, unknown = split_megatron_flags(leftovers) if ns.command != "show" else ({}, leftovers)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        check_megatron_flags(megatron)
        return {"plan": cmd_plan, "estimate": cmd_estimate, "show": cmd_show}[ns.command](ns)
    except PipetteError as e:
        print(f"pipette {ns.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
