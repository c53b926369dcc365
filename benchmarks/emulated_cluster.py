"""Validation on an emulated multi-node cluster (tools/emucluster; root, iproute2 and tc needed).

    .venv/bin/python benchmarks/emulated_cluster.py [--only probe|placement|predictions] [--out out/emulated_cluster]

1. Probe fidelity: 3 nodes x 1 process, links shaped with tbf (node 2 at a quarter of the rate);
   the probe's inter-node bandwidth per pair against the shaped path rate min(rate_i, rate_j).
2. Placement pays off: 4 nodes x 1 process, node 1's link 10x slower; the tiny GPT (PP=4, TP=1,
   DP=1, non-interleaved) trains under --auto-parallel (probe, profile, plan, placement in the job),
   then again with the same plan document pinned but node_order = identity (Megatron's default
   rank order). Iteration times (Megatron's "elapsed time per iteration (ms)", first iterations
   skipped) and their ratio.
3. Predictions meet measurements: 22 layouts on the placement cluster (TP across nodes, PP, DP,
   micro-batch sizes, node orders, interleaving, full and selective recomputation), each pinned
   through --auto-parallel-plan-file, against the planner's prediction from the placement run's
   own probe and layer profile: error per layout, MAPE, Kendall tau, chosen vs fastest.
Writes results.json and every node's log under --out. Every namespace is deleted at exit.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.emucluster import EmuCluster, unavailable_reason  # noqa: E402

PY = str(REPO / ".venv" / "bin" / "python")
ITER_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def probe_fidelity(out: Path, rates: list[float]) -> dict:
    desc = {"nodes": len(rates), "overrides": {str(k): {"rate_mbit": r} for k, r in enumerate(rates)}}
    cluster_json = out / "probe" / "cluster.json"
    cluster_json.parent.mkdir(parents=True, exist_ok=True)
    with EmuCluster(desc, tag="p") as cl:
        t0 = time.monotonic()
        res = cl.torchrun(["-m", "megatron_pipette.probe", "--out", str(cluster_json), "--large-bytes", "4M",
                           "--budget-s", "60"], nproc_per_node=1, timeout=150, cwd=str(REPO), python=PY,
                          logdir=out / "probe")
        wall = time.monotonic() - t0
        spec = cl.spec
    if any(r.returncode != 0 for r in res):
        raise RuntimeError("probe failed:\n" + "\n".join(r.output[-2000:] for r in res))
    doc = json.loads(cluster_json.read_text())
    rows = []
    n = len(rates)
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            want, _ = spec.expected_link(i, j)
            inter = doc["inter_node"]     # one process per node: its one rail
            got = inter["bandwidth_Bps"][i][j]
            rows.append({"src": i, "dst": j, "shaped_Bps": want, "probed_Bps": got,
                         "error": got / want - 1, "latency_s": inter["latency_s"][i][j],
                         "two_way_Bps": inter["exchange_bandwidth_Bps"][i][j]})
    print(f"\n## Probe fidelity: {n} nodes x 1 process, rates (Mbit/s) {rates}, probe wall {wall:.1f} s")
    print(f"{'link':>6} {'shaped MB/s':>12} {'probed MB/s':>12} {'error':>8} {'latency ms':>11} {'two-way MB/s':>13}")
    for r in rows:
        print(f"{r['src']}->{r['dst']:<3} {r['shaped_Bps'] / 1e6:12.2f} {r['probed_Bps'] / 1e6:12.2f} "
              f"{r['error']:+8.1%} {r['latency_s'] * 1e3:11.3f} {r['two_way_Bps'] / 1e6:13.2f}")
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst |error| {worst:.1%} (bar: 25%)")
    return {"rates_mbit": rates, "links": rows, "worst_abs_error": worst, "probe_wall_s": wall,
            "cluster_file": str(cluster_json)}


GPT = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
       "--seq-length", "256", "--max-position-embeddings", "256", "--untie-embeddings-and-output-weights",
       "--micro-batch-size", "4", "--global-batch-size", "16",
       "--lr", "5e-3", "--min-lr", "5e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--num-workers", "0",
       "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
       "--distributed-backend", "gloo", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
       "--tensor-model-parallel-size", "1"]


def train(desc: dict, out: Path, name: str, extra: list[str], iters: int, pp: int) -> tuple[list[float], str]:
    with EmuCluster(desc, tag=name[:4]) as cl:
        res = cl.torchrun([str(REPO / "examples" / "pretrain_gpt.py"), *GPT, "--train-iters", str(iters),
                           "--pipeline-model-parallel-size", str(pp), *extra],
                          nproc_per_node=1, timeout=420, cwd=str(REPO), python=PY, logdir=out / name)
    text = "\n".join(r.output for r in res)
    if any(r.returncode != 0 for r in res):
        raise RuntimeError(f"{name} failed:\n" + "\n".join(r.output[-3000:] for r in res))
    times = {int(i): float(ms) for i, ms in ITER_MS.findall(text)}
    return [times[i] for i in sorted(times)], text


def placement(out: Path, fast: float, slow_node: int, nodes: int, iters: int, skip: int) -> dict:
    rates = [fast] * nodes
    rates[slow_node] = fast / 10
    desc = {"nodes": nodes, "overrides": {str(k): {"rate_mbit": r} for k, r in enumerate(rates)}}
    cache = out / "placement" / "cache"
    planned, log = train(desc, out / "placement", "planned",
                         ["--auto-parallel", "--auto-parallel-budget-s", "120",
                          "--auto-parallel-cache-dir", str(cache)], iters, nodes)
    (plan_file,) = cache.glob("*/plan.json")
    doc = json.loads(plan_file.read_text())
    order = doc["candidates"][0]["placement"]["node_order"]
    predicted = doc["candidates"][0]["iteration_time_s"]
    ident = json.loads(json.dumps(doc))
    ident["candidates"][0]["placement"]["node_order"] = list(range(nodes))
    ident_file = out / "placement" / "identity_plan.json"
    ident_file.write_text(json.dumps(ident))
    default, _ = train(desc, out / "placement", "default",
                       ["--auto-parallel", "--auto-parallel-plan-file", str(ident_file),
                        "--auto-parallel-cache-dir", str(out / "placement" / "cache-identity")], iters, nodes)
    p_med = statistics.median(planned[skip:])
    d_med = statistics.median(default[skip:])
    print(f"\n## Placement: {nodes} nodes x 1 process, PP={nodes}, rates (Mbit/s) {rates}")
    print(f"planner's node_order {order} (predicted {predicted:.3f} s/iteration)")
    print(f"{'run':>10} {'node_order':>14} {'median ms':>10}  per-iteration ms (first {skip} skipped)")
    print(f"{'default':>10} {str(list(range(nodes))):>14} {d_med:10.1f}  {[round(t) for t in default]}")
    print(f"{'placed':>10} {str(order):>14} {p_med:10.1f}  {[round(t) for t in planned]}")
    print(f"default / placed = {d_med / p_med:.2f}x")
    return {"rates_mbit": rates, "node_order": order, "predicted_s": predicted, "default_ms": default,
            "placed_ms": planned, "skip": skip, "default_median_ms": d_med, "placed_median_ms": p_med,
            "ratio": d_med / p_med, "plan_file": str(plan_file)}


PRED_FLAGS = ["estimate", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
              "--seq-length", "256", "--max-position-embeddings", "256", "--untie-embeddings-and-output-weights",
              "--global-batch-size", "16", "--vocab-size", "1024", "--fp32"]


def sweep_layout(nodes: int, tp: int = 1, pp: int = 1, mbs: int = 1, vpp: int | None = None,
                 recompute: str | None = None) -> dict:
    """Layout fields (plan-document names) of one sweep point on `nodes` one-process nodes."""
    full = recompute == "full"
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "data_parallel_size": nodes // (tp * pp), "micro_batch_size": mbs,
            "num_layers_per_virtual_pipeline_stage": vpp, "recompute_granularity": recompute,
            "recompute_method": "uniform" if full else None, "recompute_num_layers": 1 if full else None}


def layout_name(fields: dict, order: list[int]) -> str:
    name = (f"tp{fields['tensor_model_parallel_size']}-pp{fields['pipeline_model_parallel_size']}"
            f"-dp{fields['data_parallel_size']}-mbs{fields['micro_batch_size']}")
    if fields["num_layers_per_virtual_pipeline_stage"]:
        name += f"-lpv{fields['num_layers_per_virtual_pipeline_stage']}"
    if fields["recompute_granularity"]:
        name += f"-rc{fields['recompute_granularity'][0]}"
    return f"{name}-{''.join(map(str, order))}"


def predict(cache_dir: Path, fields: dict, order: list[int]) -> float:
    """The planner's iteration time for one layout and node order, from the hook's own probe
    (cluster.json) and CPU layer profile (layer_profile.json): the path the hook plans with."""
    from megatron_pipette.cli.args import workload_from_args
    from megatron_pipette.cli.main import build_parser
    from megatron_pipette.cost.model import CostModel
    from megatron_pipette.plan.placement import Placement
    from megatron_pipette.plan.planner import evaluate
    from megatron_pipette.spec.job import resolve_job
    from megatron_pipette.spec.cluster_file import cluster_from_json
    from megatron_pipette.spec.layer_profile import profile_from_json
    from megatron_pipette.spec.layout import Layout

    workload = workload_from_args(build_parser().parse_args(PRED_FLAGS), None)
    cluster = cluster_from_json(json.loads((cache_dir / "cluster.json").read_text()))
    profile = profile_from_json(json.loads((cache_dir / "layer_profile.json").read_text()))
    time, _ = evaluate(CostModel(cluster, profile=profile), resolve_job(workload, Layout(**fields)),
                       Placement(tuple(order), cluster.gpus_per_node))
    return time.iteration_time_s


def kendall_tau(a: list[float], b: list[float]) -> float:
    import itertools
    conc = disc = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        s = (a[i] - a[j]) * (b[i] - b[j])
        conc += s > 0
        disc += s < 0
    return (conc - disc) / max(1, conc + disc)


def predictions(out: Path, iters: int, skip: int, nodes: int = 4) -> dict:
    """22 layouts pinned one by one on the placement cluster (section 3 of the module docstring)."""
    placed = json.loads((out / "results.json").read_text())["placement"]
    rates = placed["rates_mbit"]
    desc = {"nodes": nodes, "overrides": {str(k): {"rate_mbit": r} for k, r in enumerate(rates)}}
    cache_dir = Path(placed["plan_file"]).parent
    base = json.loads(Path(placed["plan_file"]).read_text())
    planner_order = placed["node_order"]
    ident = list(range(nodes))
    layouts = []
    for mbs in (1, 2, 4):
        layouts += [(sweep_layout(nodes, pp=4, mbs=mbs), ident), (sweep_layout(nodes, pp=4, mbs=mbs), planner_order),
                    (sweep_layout(nodes, pp=2, mbs=mbs), ident), (sweep_layout(nodes, pp=2, mbs=mbs), [0, 2, 1, 3]),
                    (sweep_layout(nodes, mbs=mbs), ident)]
    layouts += [(sweep_layout(nodes, pp=2, mbs=2, vpp=1), ident),                  # interleaved, 2 chunks per rank
                (sweep_layout(nodes, pp=2, mbs=2, vpp=1), [0, 2, 1, 3]),
                (sweep_layout(nodes, pp=4, mbs=2, recompute="full"), planner_order),
                (sweep_layout(nodes, pp=2, mbs=2, recompute="selective"), ident),
                (sweep_layout(nodes, tp=2, pp=2, mbs=2), ident),                    # TP across nodes
                (sweep_layout(nodes, tp=2, mbs=2), ident),
                (sweep_layout(nodes, tp=2, mbs=2), [0, 2, 1, 3])]
    rows = []
    for fields, order in layouts:
        doc = json.loads(json.dumps(base))
        cand = doc["candidates"][0]
        cand["layout"].update(fields)
        cand["placement"]["node_order"] = order
        doc["candidates"] = [cand]
        name = layout_name(fields, order)
        f = out / "layouts" / f"{name}.json"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(doc))
        pred = predict(cache_dir, fields, order)
        pp, mbs = fields["pipeline_model_parallel_size"], fields["micro_batch_size"]
        try:
            times, _ = train(desc, out / "layouts", name,
                             ["--auto-parallel", "--auto-parallel-plan-file", str(f),
                              "--auto-parallel-cache-dir", str(out / "layouts" / "cache"),
                              "--micro-batch-size", str(mbs)], iters, pp)
            meas = statistics.median(times[skip:]) / 1e3
        except RuntimeError as e:
            print(f"{name}: failed: {str(e)[:300]}")
            continue
        rows.append({"layout": name, "fields": fields, "node_order": order, "predicted_s": pred,
                     "measured_s": meas, "error": pred / meas - 1})
        print(f"{name:>22} predicted {pred:7.3f} s measured {meas:7.3f} s error {pred / meas - 1:+7.1%}", flush=True)
    pred = [r["predicted_s"] for r in rows]
    meas = [r["measured_s"] for r in rows]
    mape = statistics.mean(abs(r["error"]) for r in rows)
    tau = kendall_tau(pred, meas)
    chosen = min(rows, key=lambda r: r["predicted_s"])
    best = min(rows, key=lambda r: r["measured_s"])
    print(f"\n## Predictions vs measurements: {len(rows)} layouts, rates (Mbit/s) {rates}")
    print(f"{'layout':>22} {'predicted s':>12} {'measured s':>11} {'error':>8}")
    for r in rows:
        print(f"{r['layout']:>22} {r['predicted_s']:12.3f} {r['measured_s']:11.3f} {r['error']:+8.1%}")
    within = chosen["measured_s"] <= 1.1 * best["measured_s"]
    print(f"MAPE {mape:.1%} (bar 15%), Kendall tau {tau:.2f} (bar 0.7); predicted-best {chosen['layout']} "
          f"measures {chosen['measured_s']:.3f} s, fastest measured {best['layout']} {best['measured_s']:.3f} s: "
          f"{'within' if within else 'NOT within'} 10%")
    return {"rows": rows, "mape": mape, "kendall_tau": tau, "predicted_best": chosen["layout"],
            "measured_best": best["layout"], "chosen_within_10pct": within}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "out" / "emulated_cluster")
    p.add_argument("--only", choices=("probe", "placement", "predictions"))
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--pred-iters", type=int, default=5)
    args = p.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"emulated cluster unavailable: {reason}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    if args.only in (None, "probe"):
        results["probe"] = probe_fidelity(args.out, [200.0, 200.0, 50.0])
        results_file.write_text(json.dumps(results, indent=1))
    if args.only in (None, "placement"):
        results["placement"] = placement(args.out, fast=250.0, slow_node=1, nodes=4, iters=args.iters,
                                         skip=args.skip)
        results_file.write_text(json.dumps(results, indent=1))
    if args.only in (None, "predictions"):
        results["predictions"] = predictions(args.out, iters=args.pred_iters, skip=args.skip)
        results_file.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
