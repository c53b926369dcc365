"""Time to plan a 96-layer GPT-3-175B-sized model at growing scale, placement included.

Each cluster is DGX A100 nodes whose inter-node links are non-uniform: every node gets a
random NIC speed factor in [0.3, 1.0] (seeded), and a pair's bandwidth is the slower of
the two. Planning is timed after the cluster is built (building the N x N matrices is
reported separately). Run on one core:

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/plan_scaling.py
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from megatron_pipette.plan.planner import plan
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.workload import workload_from_preset

BARS_S = {1024: 5.0, 8192: 60.0}


def nonuniform_cluster(num_gpus: int, seed: int = 0):
    base = preset_cluster("dgx-a100", num_nodes=num_gpus // 8)
    factor = np.random.default_rng(seed).uniform(0.3, 1.0, size=base.num_nodes)
    node = np.arange(base.world_size) // 8
    pair = np.minimum(factor[node][:, None], factor[node][None, :])
    same = node[:, None] == node[None, :]
    return dataclasses.replace(base, name=f"dgx-a100x{base.num_nodes}-nonuniform",
                               bandwidth_Bps=np.where(same, base.bandwidth_Bps, base.bandwidth_Bps * pair))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[64, 512, 1024, 4096, 8192])
    ns = parser.parse_args()
    workload = workload_from_preset("gpt3-175b")
    print(f"{'GPUs':>6} {'build s':>8} {'plan s':>8} {'layouts':>8} {'fit':>6} {'bar s':>6}  best layout (s/iter, placement gain)")
    for gpus in ns.gpus:
        t0 = time.perf_counter()
        cluster = nonuniform_cluster(gpus)
        t1 = time.perf_counter()
        result = plan(workload, cluster)
        t2 = time.perf_counter()
        bar = BARS_S.get(gpus)
        best = result.best
        summary = "nothing fits"
        if best:
            gain = 100 * (1 - best.time.iteration_time_s / best.default_order_time_s)
            summary = f"{best.layout.describe()} ({best.time.iteration_time_s:.2f} s, {gain:+.1f}%)"
        print(f"{gpus:>6} {t1 - t0:>8.2f} {t2 - t1:>8.2f} {result.considered:>8} "
              f"{result.considered - result.out_of_memory:>6} {bar if bar else '-':>6}  {summary}", flush=True)


if __name__ == "__main__":
    main()
