"""Time and peak memory to plan a model (GPT-3 175B; --model mixtral-8x22b for mixture of experts,
whose search adds expert-parallel sizes) at growing scale, placement included.

Two clusters per size, both DGX H100 nodes: the preset (uniform links) and a non-uniform
one whose every node gets a random NIC speed factor in [0.3, 1.0] (seeded), a node pair's
bandwidth being the slower of the two (a dense node x node matrix, as a probe writes it).
Each case runs in a fresh process so its peak resident memory (ru_maxrss) is its own; the
cluster build is timed apart from the planning. Run on one core:

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 taskset -c 0 .venv/bin/python -m benchmarks.validation.plan_scaling
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time

import numpy as np

from megatron_pipette.cost.model import CostModel
from megatron_pipette.plan.planner import plan
from megatron_pipette.spec.hardware import LinkLevel, preset_cluster
from megatron_pipette.spec.workload import workload_from_preset

BARS = {1024: (5.0, None), 16384: (10.0, 2.0), 131072: (120.0, 8.0)}
"""GPUs -> (seconds, GiB) the planner must stay within."""
GPUS_PER_NODE = 8


def cluster(gpus: int, kind: str, seed: int = 0):
    base = preset_cluster("dgx-h100", num_nodes=gpus // GPUS_PER_NODE)
    if kind == "uniform":
        return base
    factor = np.random.default_rng(seed).uniform(0.3, 1.0, size=base.num_nodes)
    bw = base.inter_node.bandwidth_Bps[0, 0] * np.minimum(factor[:, None], factor[None, :])
    return dataclasses.replace(base, name=f"{base.name}-nonuniform",
                               inter_node=LinkLevel(bandwidth_Bps=bw, latency_s=base.inter_node.latency_s))


def one(gpus: int, kind: str, model: str) -> dict:
    workload = workload_from_preset(model)
    t0 = time.perf_counter()
    c = cluster(gpus, kind)
    t1 = time.perf_counter()
    result = plan(workload, CostModel(c))
    t2 = time.perf_counter()
    best = result.best
    summary = "nothing fits"
    if best:
        gain = 100 * (1 - best.time.iteration_time_s / best.default_order_time_s)
        summary = f"{best.layout.describe()} ({best.time.iteration_time_s:.2f} s, placement {gain:+.1f}%)"
    return {"build_s": t1 - t0, "plan_s": t2 - t1, "layouts": result.considered,
            "fit": result.considered - result.out_of_memory, "best": summary,
            "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[64, 1024, 8192, 16384, 131072])
    parser.add_argument("--kinds", nargs="+", default=["uniform", "nonuniform"], choices=["uniform", "nonuniform"])
    parser.add_argument("--model", default="gpt3-175b", help="a model preset (default gpt3-175b)")
    parser.add_argument("--one", nargs=2, metavar=("GPUS", "KIND"), help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.one:
        print(json.dumps(one(int(ns.one[0]), ns.one[1], ns.model)))
        return
    print(f"model {ns.model}")
    print(f"{'GPUs':>7} {'links':>10} {'build s':>8} {'plan s':>8} {'peak GiB':>9} {'layouts':>8} {'fit':>6} "
          f"{'bar':>12}  best layout (s/iter, placement gain)")
    for gpus in ns.gpus:
        for kind in ns.kinds:
            proc = subprocess.run([sys.executable, __file__, "--one", str(gpus), kind, "--model", ns.model],
                                  capture_output=True,
                                  text=True, check=True)
            r = json.loads(proc.stdout)
            seconds, gib = BARS.get(gpus, (None, None))
            bar = "-" if seconds is None else f"{seconds:g} s" + (f", {gib:g} GiB" if gib else "")
            print(f"{gpus:>7} {kind:>10} {r['build_s']:>8.2f} {r['plan_s']:>8.2f} {r['peak_gib']:>9.2f} "
                  f"{r['layouts']:>8} {r['fit']:>6} {bar:>12}  {r['best']}", flush=True)


if __name__ == "__main__":
    main()
