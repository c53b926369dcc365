"""The probe twin at scale: simulated probe time, wall time, what it finds, and what the plan loses.

    .venv/bin/python benchmarks/probe_twin.py [--nodes 1024 2048] [--budget-s 30] [--noise 0.05]

For each size: DGX H100 nodes (8 GPUs), one node at a quarter of the NIC rate and one node pair
at a tenth; the probe's real logic runs on its twin within the budget. Printed: the simulated
probe time, the wall time of the twin, the slow node and pair it reports (rate found vs truth),
the error of its node x node bandwidth against the truth, and GPT-3 175B planned on the probed
cluster and on the truth, both priced on the truth. The document's build is timed right after the
twin's run (the first touch of fresh memory after the twin's own allocations costs kernel time)
and again, --rebuilds times, from the same measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from megatron_pipette.cost.model import CostModel
from megatron_pipette.plan.planner import evaluate, plan
from megatron_pipette.probe.schedule import node_pairs_met
from megatron_pipette.probe.twin import compare_to_truth, run_twin
from megatron_pipette.spec.cluster_file import cluster_from_json
from megatron_pipette.spec.hardware import LinkLevel, preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.workload import workload_from_preset

SLOW_NODE, SLOW_PAIR = 3, (5, 9)


def truth_cluster(nodes: int):
    base = preset_cluster("dgx-h100", num_nodes=nodes)
    rate = float(base.inter_node.bandwidth_Bps[0, 0])
    bw = np.full((nodes, nodes), rate)
    bw[SLOW_NODE, :] = bw[:, SLOW_NODE] = rate / 4
    a, b = SLOW_PAIR
    bw[a, b] = bw[b, a] = rate / 10
    return dataclasses.replace(base, name=f"truth-{nodes}",
                               inter_node=LinkLevel(bandwidth_Bps=bw, latency_s=base.inter_node.latency_s)), rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--budget-s", type=float, default=30.0)
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rebuilds", type=int, default=3, help="times the document is built again, timed alone")
    ns = parser.parse_args()
    workload = workload_from_preset("gpt3-175b")
    for nodes in ns.nodes:
        truth, rate = truth_cluster(nodes)
        start = time.perf_counter()
        run = run_twin(truth, budget_s=ns.budget_s, small_bytes=4096, large_bytes=64 << 20, repeats=3,
                       noise=ns.noise, seed=ns.seed)
        wall = time.perf_counter() - start
        doc = run.doc
        probed = cluster_from_json(doc)
        p = doc["probe"]
        errors = compare_to_truth(probed, truth, node_pairs_met(nodes, 8, p["inter_rounds_measured"]))
        print(f"\n{nodes * 8} GPUs ({nodes} nodes), budget {ns.budget_s:g} s, noise {ns.noise:g}")
        rebuilt = []
        for _ in range(ns.rebuilds):
            t0 = time.perf_counter()
            run.build()
            rebuilt.append(time.perf_counter() - t0)
        print(f"  simulated probe {run.simulated_s:.2f} s, twin wall {wall:.2f} s (document build "
              f"{run.document_build_s:.2f} s, rebuilt from the same measurements in "
              f"{', '.join(f'{t:.2f}' for t in rebuilt)} s); {p['inter_rounds_measured']} of "
              f"{p['inter_rounds']} inter-node rounds, {p['node_pairs_measured']} of {nodes * (nodes - 1) // 2} "
              f"node pairs")
        for s in p["slow_nodes"]:
            print(f"  slow node {s['node']}: {s['rate_Bps'] / 1e9:.2f} GB/s (truth "
                  f"{(rate / 4 if s['node'] == SLOW_NODE else rate) / 1e9:.2f})")
        for s in p["slow_links"]:
            print(f"  slow link {s['nodes']}: {s['bandwidth_Bps'] / 1e9:.2f} GB/s "
                  f"(truth {truth.inter_node.bandwidth_Bps[tuple(s['nodes'])] / 1e9:.2f})")
        print(f"  node x node bandwidth vs truth: median error {errors['median']:.1%}, worst {errors['worst']:.1%}, "
              f"worst measured {errors['worst_measured']:.1%}")
        priced = {}
        for name, cluster in (("probed", probed), ("truth", truth)):
            t0 = time.perf_counter()
            best = plan(workload, CostModel(cluster), top_k=3).best
            planned = time.perf_counter() - t0
            on_truth, _ = evaluate(CostModel(truth), resolve_job(workload, best.layout), best.placement)
            priced[name] = on_truth.iteration_time_s
            print(f"  planned on the {name:>6} cluster in {planned:5.1f} s: {best.layout.describe()}, "
                  f"{on_truth.iteration_time_s:.4f} s/iteration on the truth")
        print(f"  probed plan / truth plan on the truth: {priced['probed'] / priced['truth']:.4f} (bar 1.03)")


if __name__ == "__main__":
    main()
