"""The probe twin at scale: simulated probe time, wall time, what it finds, and what the plan loses.

    .venv/bin/python -m benchmarks.validation.probe_twin [--nodes 1024 2048] [--budget-s 30] [--noise 0.05]

For each size: DGX H100 nodes (8 GPUs), one node at a quarter of the NIC rate and one node pair
at a tenth; the probe's real logic runs on its twin within the budget. Printed: the simulated
probe time, the wall time of the twin, the slow node and pair it reports (rate found vs truth),
the error of its node x node bandwidth against the truth, and GPT-3 175B planned on the probed
cluster and on the truth, both priced on the truth. The document's build is timed right after the
twin's run (the first touch of fresh memory after the twin's own allocations costs kernel time)
and again, --rebuilds times, from the same measurements.

Then the loss of one node (--lost, default the middle one): the probed file is cached as a first
start's entry with its plan for the loss of a node (`replan.store_loss_plan`, timed), and a restart
on the survivors runs rank 0's look-up (`replan.look_up`, timed: wall time, and the process's CPU
time, which the machine's load does not inflate), which must neither probe nor search: the probe is
found by host and reused, the stored layout placed on the survivors and checked. Megatron needs
--global-batch-size divisible by the data-parallel size, and no layout of GPT-3 175B with its
batch of 1536 exists on 2047 DGX nodes (2047 = 23 x 89), so the loss is planned for GPT-3 13B with
a batch of 8 x 2047 and a synthetic layer profile (the hook's path reuses a profile; its times do
not change what the re-plan costs). Last, a spare node takes the lost one's place: the probe on
that allocation measures only rounds with the new node in them (schedule's known_nodes) and keeps
the first probe's figures for the other pairs (ClusterFile.with_known).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import shutil
import tempfile
import time

import numpy as np

from megatron_pipette.cost.model import CostModel
from megatron_pipette.integration import replan
from megatron_pipette.integration.cache import CLUSTER, LOSS_PLAN, NODES, PROFILE, Entry, node_index
from megatron_pipette.integration.common import Phases
from megatron_pipette.integration.plan_check import JobRequest
from megatron_pipette.plan.planner import evaluate, plan
from megatron_pipette.probe.schedule import node_pairs_met
from megatron_pipette.probe.twin import compare_to_truth, run_twin
from megatron_pipette.spec.cluster_file import ClusterFile, cluster_from_json
from megatron_pipette.spec.hardware import LinkLevel, preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import SCHEMA as PROFILE_SCHEMA
from megatron_pipette.spec.layer_profile import profile_model_fields
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


def synthetic_profile(workload, device_name: str) -> dict:
    """A layer profile of `workload` priced at 400 TFLOP/s (forward 24 h^2 s FLOPs a sequence, backward
    twice that), activations at 34 s h bytes: stands in for the one a first start measures."""
    h, s = workload.hidden_size, workload.seq_length
    forward = 24 * h * h * s / 400e12
    return {"schema": PROFILE_SCHEMA, "version": 1, "device": {"rank": 0, "device_name": device_name},
            "model": profile_model_fields(workload),
            "layers": [{"tensor_model_parallel_size": tp, "micro_batch_size": mbs, "forward_s": forward * mbs / tp,
                        "backward_s": 2 * forward * mbs / tp, "activation_bytes": 34 * s * h * mbs // tp}
                       for tp in (1, 2, 4, 8) for mbs in (1, 2, 4, 8)]}


def lose_a_node(probed: ClusterFile, lost: int, replans: int) -> None:
    """A first start's entry on `probed` with its loss plan, then rank 0's look-up after losing `lost`
    (`replans` times, the machine's load varying)."""
    nodes = probed.cluster.num_nodes
    workload = dataclasses.replace(workload_from_preset("gpt3-13b"), global_batch_size=8 * (nodes - 1))
    survivors = [k for k in range(nodes) if k != lost]
    with tempfile.TemporaryDirectory() as cache:
        first = Entry(cache, "0" * 16)
        first.open()
        started = time.perf_counter()
        first.write(CLUSTER, probed.to_json())
        first.write(NODES, node_index(probed.node_identities))
        first.write(PROFILE, synthetic_profile(workload, probed.cluster.gpu.name))
        cached = time.perf_counter() - started
        phases = Phases()
        model = CostModel(probed.cluster, profile=first.read(PROFILE).profile)
        with contextlib.redirect_stdout(io.StringIO()):     # the hook's log lines and plan report
            replan.store_loss_plan(JobRequest(workload=workload, world_size=probed.cluster.world_size,
                                              gpus_per_node=8), model, first, phases)
        loss = first.read(LOSS_PLAN)
        print(f"  loss of a node, gpt3-13b with --global-batch-size {workload.global_batch_size}: the first start "
              f"caches its probe in {cached:.2f} s and searches its plan for {nodes - 1} nodes in "
              f"{phases.seconds['loss plan']:.1f} s ({len(loss.candidates)} layouts kept, best "
              f"{loss.best.layout.describe()})")
        for attempt in range(replans):       # each a restart into an entry of its own
            later = Entry(cache, f"{attempt + 1:016x}")
            later.open()
            phases = Phases()
            started, cpu = time.perf_counter(), time.process_time()
            with contextlib.redirect_stdout(io.StringIO()):
                start = replan.look_up(later, JobRequest(workload=workload, world_size=8 * len(survivors),
                                                         gpus_per_node=8), replan.Switches(), phases,
                                       nodes=[probed.node_identities[k] for k in survivors])
            replanned, cpu = time.perf_counter() - started, time.process_time() - cpu
            start.caching.join()
            cached = time.perf_counter() - started - replanned
            shutil.rmtree(later.path)       # the next restart finds the first start's entry, not this one
            searched = "loss plan" in phases.seconds or \
                start.plan.best.layout not in [c.layout for c in loss.candidates]
            print(f"  after losing node {lost}: re-planned in {replanned:.2f} s (bar 2 s; {cpu:.2f} s of CPU, load "
                  f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores), placing the stored layout "
                  f"{phases.seconds['plan']:.2f} s of it; probe {phases.skipped.get('probe', 'ran')}, profile "
                  f"{phases.skipped.get('profile', 'ran')}, {'searched' if searched else 'no search'}: "
                  f"{start.plan.best.layout.describe()}, {start.plan.best.iteration_time_s:.3f} s/iteration; the "
                  f"survivors' probe written to the cache on a thread, {cached:.2f} s after the plan")


def replace_a_node(truth, probed: ClusterFile, lost: int, budget_s: float, noise: float, seed: int) -> None:
    """The probe of `truth` with node `lost` replaced by a spare (a new host), told the others are known."""
    hosts = tuple("spare" if k == lost else f"node{k}" for k in range(truth.num_nodes))
    started = time.perf_counter()
    run = run_twin(dataclasses.replace(truth, hosts=hosts), budget_s=budget_s, small_bytes=4096,
                   large_bytes=64 << 20, repeats=3, noise=noise, seed=seed,
                   known_nodes=np.array([k != lost for k in range(truth.num_nodes)]))
    wall = time.perf_counter() - started
    now = ClusterFile.from_json(run.doc)
    where = probed.nodes_of(now.node_identities)
    merged = now.with_known(probed, where)
    p = now.probe
    print(f"  a spare in place of node {lost}: probed in {run.simulated_s:.2f} s simulated ({wall:.1f} s wall), "
          f"{p.inter_rounds_measured} inter-node rounds, {p.node_pairs_measured} node pairs measured; "
          f"{int(merged.measured_pairs.sum()) // 2} pairs measured with the first probe's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--budget-s", type=float, default=30.0)
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rebuilds", type=int, default=3, help="times the document is built again, timed alone")
    parser.add_argument("--lost", type=int, default=None, help="the node lost (default: the middle one)")
    parser.add_argument("--replans", type=int, default=3, help="restarts timed after the loss")
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
        lost = nodes // 2 if ns.lost is None else ns.lost
        lose_a_node(ClusterFile.from_json(doc), lost, ns.replans)
        replace_a_node(truth, ClusterFile.from_json(doc), lost, ns.budget_s, ns.noise, ns.seed)


if __name__ == "__main__":
    main()
