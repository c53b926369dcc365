"""The measurement commands: `pipette probe` (under torchrun), `profile`, `compare`, `probe-sim`, `show`.

torch is imported only inside `probe` and `profile`, so the others run where it is not installed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

from megatron_pipette.cli.args import (
    DEFAULT_CLUSTER,
    add_cluster_flags,
    add_workload_flags,
    workload_from_args,
)
from megatron_pipette.cli.planning import show_plan
from megatron_pipette.errors import PipetteError
from megatron_pipette.files import read_json, write_cluster_file
from megatron_pipette.probe.options import check_args, check_seconds, out_problem, parse_size
from megatron_pipette.profile.request import check_request
from megatron_pipette.report import plans
from megatron_pipette.units import MiB

DEFAULT_LARGE_CUDA = 64 * MiB
DEFAULT_LARGE_CPU = 4 * MiB
PROFILE_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
RECOMPUTE_CHOICES = {"none": None, "selective": "selective", "full": "full"}
MAX_NOISE = 10.0
"""The widest lognormal sigma of the probe twin's timing noise (e^10: timings off by 22,000x)."""


def add_probe_parser(sub) -> None:
    p = sub.add_parser("probe", help="measure this job's cluster (run under torchrun) and write the cluster file",
                       description="Measure the links inside and between nodes, an all-to-all among every "
                                   "four nodes, and every device, within a time budget; rank 0 writes the cluster "
                                   "file. Run on every rank: `torchrun ... -m megatron_pipette.probe --out "
                                   "cluster.json` (or `... -m megatron_pipette probe`).")
    p.add_argument("--out", required=True, help="cluster JSON to write (rank 0 writes it atomically)")
    p.add_argument("--budget-s", type=float, default=30.0, help="seconds the probe may take (default 30)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="process-group backend (default: nccl when CUDA is available, else gloo)")
    p.add_argument("--precision", default="bf16", help="training precision of the GEMM check (default bf16)")
    p.add_argument("--small-bytes", type=parse_size, default=4096, help="latency message size (default 4K)")
    p.add_argument("--large-bytes", type=parse_size, default=None,
                   help="bandwidth message size, and what each rank sends in the all-to-all (default 64M on GPU, "
                        "4M on CPU)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed exchanges per size and pair, and timed all-to-alls (default 5)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="give up on an unresponsive peer after this long (default 60 s + the budget)")
    p.add_argument("-v", "--verbose", action="store_true", help="log each stage's timing on every rank")
    p.set_defaults(run=cmd_probe)


def cmd_probe(ns: argparse.Namespace) -> int:
    """A user error or a failed peer ends every rank with one line naming the rank, never a traceback:
    exit 2 for a user error, 1 for a communication failure."""
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.INFO if rank == "0" else logging.WARNING,
                        format="pipette %(message)s", stream=sys.stderr)
    try:
        # Flags first: a typo should not cost a torch import and a rendezvous.
        check_args(ns.budget_s, ns.precision, ns.small_bytes, ns.large_bytes or ns.small_bytes + 1, ns.repeats)
        timeout_s = ns.timeout_s if ns.timeout_s is not None else 60.0 + ns.budget_s
        check_seconds(timeout_s, "--timeout-s")
        if "RANK" not in os.environ and (problem := out_problem(ns.out)):
            raise PipetteError(problem)   # a world of one: this process is rank 0, the writer
        from megatron_pipette.probe.runner import run_standalone

        run_standalone(backend=ns.backend, budget_s=ns.budget_s, precision=ns.precision, small_bytes=ns.small_bytes,
                       large_bytes=ns.large_bytes, cpu_large_bytes=DEFAULT_LARGE_CPU,
                       cuda_large_bytes=DEFAULT_LARGE_CUDA, repeats=ns.repeats, out=ns.out, timeout_s=timeout_s)
        return 0
    except PipetteError as e:
        print(f"pipette probe: rank {rank}: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, ConnectionError) as e:   # a failed or unreachable peer
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"pipette probe: rank {rank}: communication failed: {first}", file=sys.stderr)
        return 1


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure one transformer layer on this device; write the layer profile",
                       description="Measure one transformer layer, the embedding and the output layer (with loss) "
                                   "on this device, sharded as for each tensor-parallel size, and write the "
                                   "layer-profile JSON the planner reads with --layer-profile.")
    run = p.add_argument_group("profile")
    run.add_argument("--tp", type=int, nargs="+", default=[1], metavar="N",
                     help="tensor-parallel sizes to profile (default: 1)")
    run.add_argument("--mbs", type=int, nargs="+", default=[1], metavar="N",
                     help="micro-batch sizes; the smallest and largest are measured, the rest interpolated")
    run.add_argument("--recompute", nargs="+", choices=sorted(RECOMPUTE_CHOICES), default=list(RECOMPUTE_CHOICES),
                     help="recompute granularities to profile (default: none selective full)")
    run.add_argument("--no-sequence-parallel", action="store_true", help="leave out the sequence-parallel entries")
    run.add_argument("--cp", type=int, nargs="+", default=[1], metavar="N",
                     help="context-parallel sizes: each above 1 adds a layer over one rank's seq-length / N "
                          "tokens (default: 1)")
    run.add_argument("--out", default="layer_profile.json", help="output file (default: layer_profile.json)")
    run.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available, else cpu")
    run.add_argument("--budget-s", type=float, default=300.0,
                     help="wall-clock budget in seconds; shapes that would exceed it are skipped (default 300)")
    run.add_argument("--warmup", type=int, default=3, help="untimed iterations per shape (default 3)")
    run.add_argument("--iters", type=int, default=10, help="timed iterations per shape; the median is kept")
    run.add_argument("--rank", type=int, help="this device's rank in the cluster file (default: 0)")
    add_workload_flags(p)
    p.set_defaults(run=cmd_profile)


def profile_workload(ns: argparse.Namespace):
    """The model to profile: a layer profile does not depend on the global batch size."""
    return workload_from_args(ns, None, required=PROFILE_REQUIRED, global_batch_size=1)


def cmd_profile(ns: argparse.Namespace) -> int:
    workload = profile_workload(ns)
    recompute = tuple(RECOMPUTE_CHOICES[r] for r in ns.recompute)
    sequence_parallel = (False,) if ns.no_sequence_parallel else (False, True)
    # Flags first: a typo should not cost a torch and megatron-core import.
    check_request(workload, ns.tp, ns.mbs, recompute, sequence_parallel, ns.budget_s, ns.warmup, ns.iters, ns.cp,
                  ns.rank)
    if problem := out_problem(ns.out):
        raise PipetteError(problem)
    out = Path(ns.out)
    # megatron-core warns at import about optional kernels (Apex, TE) it falls back from.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from megatron_pipette.profile import profile_layers

    profiled = profile_layers(workload, tp_sizes=ns.tp, micro_batch_sizes=ns.mbs, recompute=recompute,
                              sequence_parallel=sequence_parallel, device=ns.device, budget_s=ns.budget_s,
                              warmup=ns.warmup, iters=ns.iters, rank=ns.rank, cp_sizes=ns.cp)
    try:
        out.write_text(json.dumps(profiled.to_json(), indent=1) + "\n")
    except OSError as e:
        raise PipetteError(f"--out {out}: cannot write ({e.strerror})") from None
    print(f"{out}: {len(profiled.profile.layers)} layer entries on {profiled.profile.device_name}, "
          f"{profiled.measured_shapes} shapes measured, {profiled.skipped_shapes} skipped (budget or memory), "
          f"{profiled.elapsed_s:.1f} s")
    return 0


def add_compare_parser(sub) -> None:
    p = sub.add_parser("compare", help="compare a measured layer profile with the planner's roofline")
    p.add_argument("profile", help="layer-profile JSON (pipette profile)")
    p.add_argument("--gpu", help="catalog GPU for the roofline times (default: the profiled device's name)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(run=cmd_compare)


def cmd_compare(ns: argparse.Namespace) -> int:
    from megatron_pipette.report.profile_compare import compare, render
    from megatron_pipette.spec.hardware import gpu_catalog, lookup_gpu
    from megatron_pipette.spec.layer_profile import ProfileFile

    profiled = ProfileFile.from_json(read_json(ns.profile, "compare"), where="layer profile")
    name = ns.gpu or profiled.profile.device_name
    gpu = lookup_gpu(ns.gpu) if ns.gpu else gpu_catalog().get(name.lower())
    rows = compare(profiled, gpu)
    print(json.dumps(rows, indent=1) if ns.json else render(rows))
    if gpu is None:
        print(f"(device {name!r} is not a catalog GPU: times not compared; pass --gpu to force)")
    return 0


def add_probe_sim_parser(sub) -> None:
    t = sub.add_parser("probe-sim", help="run the probe's logic on a simulated cluster (the probe twin)")
    t.add_argument("--truth", required=True, metavar="CLUSTER_JSON",
                   help="the cluster to simulate (schema version 1 or 2): its links price every message")
    t.add_argument("--world-size", type=int, required=True, help="ranks to simulate (must match the truth)")
    t.add_argument("--gpus-per-node", type=int, required=True, help="ranks per node (must match the truth)")
    t.add_argument("--budget-s", type=float, default=30.0, help="the probe's time budget (default 30)")
    t.add_argument("--seed", type=int, default=0, help="seed of the timing noise (default 0)")
    t.add_argument("--noise", type=float, default=0.0,
                   help="sigma of a lognormal factor on every simulated timing (default 0: exact)")
    t.add_argument("--small-bytes", type=parse_size, default=4096, help="latency message size (default 4K)")
    t.add_argument("--large-bytes", type=parse_size, default=DEFAULT_LARGE_CUDA,
                   help="bandwidth message size, and what each rank sends in the all-to-all (default 64M)")
    t.add_argument("--repeats", type=int, default=3,
                   help="timed repeats per size and pair, and timed all-to-alls (default 3)")
    t.add_argument("--out", required=True, help="the cluster file the probe would write")
    t.set_defaults(run=cmd_probe_sim)


def add_show_parser(sub) -> None:
    s = sub.add_parser("show", help="summarise a probed cluster file (and draw its link heatmap), or a plan "
                                    "(and draw its pipeline timeline)")
    s.add_argument("file", nargs="?", help="cluster JSON written by the probe")
    s.add_argument("--heatmap", metavar="PNG", help="write the bandwidth matrix as a heatmap")
    s.add_argument("--plan", metavar="PLAN_JSON",
                   help="a plan (from `plan --json` or a job's pipette_plan.json): its estimate on --cluster "
                        f"(default: the cluster file shown, else {DEFAULT_CLUSTER})")
    s.add_argument("--timeline", metavar="PNG",
                   help="with --plan: draw one iteration of its pipeline schedule (the simulator's events)")
    add_cluster_flags(s)
    s.set_defaults(run=cmd_show, cluster=None)


def cmd_probe_sim(ns: argparse.Namespace) -> int:
    from megatron_pipette.probe.schedule import node_pairs_met
    from megatron_pipette.probe.twin import compare_to_truth, run_twin
    from megatron_pipette.spec.cluster_file import ClusterFile

    check_args(ns.budget_s, "bf16", ns.small_bytes, ns.large_bytes, ns.repeats)
    if not 0 <= ns.noise <= MAX_NOISE:
        raise PipetteError(f"--noise must be in [0, {MAX_NOISE}], got {ns.noise}")
    if not 0 <= ns.seed < 2 ** 63:
        raise PipetteError(f"--seed must be an integer from 0 to 2**63 - 1, got {ns.seed}")
    if problem := out_problem(ns.out):
        raise PipetteError(problem)
    truth = ClusterFile.from_json(read_json(ns.truth, "--truth"), where=f"--truth {ns.truth}").cluster
    if (ns.world_size, ns.gpus_per_node) != (truth.world_size, truth.gpus_per_node):
        raise PipetteError(f"--world-size {ns.world_size} --gpus-per-node {ns.gpus_per_node} do not match "
                           f"--truth {ns.truth} ({truth.num_nodes} nodes x {truth.gpus_per_node} = "
                           f"{truth.world_size} GPUs)")
    started = time.perf_counter()
    run = run_twin(truth, budget_s=ns.budget_s, small_bytes=ns.small_bytes, large_bytes=ns.large_bytes,
                   repeats=ns.repeats, noise=ns.noise, seed=ns.seed)
    probed = ClusterFile.from_json(run.doc, where="probe-sim")
    write_cluster_file(probed.to_json(), probed.cluster.world_size, ns.out)
    wall_s = time.perf_counter() - started
    errors = compare_to_truth(probed.cluster, truth, node_pairs_met(truth.num_nodes, truth.gpus_per_node,
                                                                    probed.probe.inter_rounds_measured))
    print(plans.twin_report(probed, run.simulated_s, wall_s, run.document_build_s, errors))
    print(f"wrote {ns.out}")
    return 0


def cmd_show(ns: argparse.Namespace) -> int:
    if ns.heatmap and ns.file is None:
        raise PipetteError(f"--heatmap {ns.heatmap} draws a cluster file's links: give the file")
    if ns.timeline and ns.plan is None:
        raise PipetteError(f"--timeline {ns.timeline} draws a plan: give --plan PLAN_JSON")
    if ns.file is None and ns.plan is None:
        raise PipetteError("give a cluster file to summarise, or --plan PLAN_JSON")
    pricing = [flag for flag, value in (("--cluster", ns.cluster), ("--gpu", ns.gpu), ("--num-nodes", ns.num_nodes),
                                        ("--gpus-per-node", ns.gpus_per_node), ("--layer-profile", ns.layer_profile))
               if value is not None]
    if pricing and ns.plan is None:
        raise PipetteError(f"{', '.join(pricing)} price a plan: give --plan PLAN_JSON")
    if ns.file is not None:
        show_cluster(ns)
    if ns.plan is not None:
        ns.cluster = ns.cluster or ns.file or DEFAULT_CLUSTER
        show_plan(ns)
    return 0


def show_cluster(ns: argparse.Namespace) -> None:
    from megatron_pipette.report.cluster_report import summarize, write_heatmap
    from megatron_pipette.spec.cluster_file import ClusterFile

    if ns.heatmap and (problem := out_problem(ns.heatmap, "--heatmap")):
        raise PipetteError(problem)
    shown = ClusterFile.from_json(read_json(ns.file, "show"), where=ns.file)  # as `plan --cluster` reads it
    print(summarize(shown))
    if ns.heatmap:
        write_heatmap(shown.cluster, ns.heatmap)
        print(f"heatmap written to {ns.heatmap}")
