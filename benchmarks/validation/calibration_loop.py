"""The calibration loop closed on a deliberately mis-set cluster file.

    python -m benchmarks.validation.calibration_loop [--emulated] [--factor 0.25] [--rate-mbit 400] [--out DIR]

1. Seed: a small GPT under --auto-parallel --auto-parallel-dry-run probes the links, profiles a
   layer and plans; the allocation's cache directory then holds cluster.json, layer_profile.json
   and plan.json.
2. Mis-set: every bandwidth of the cached cluster.json (inter-node on the emulated cluster,
   intra-node on one host) is multiplied by --factor, and plan.json is removed.
3. Run A: the job plans from the mis-set file, trains, and its self-check measures the chosen
   layout against the prediction and fits the calibration.
4. Run B: the next start, with --auto-parallel-replan-if-slower PCT, plans with the calibrated
   model, switches when it finds a layout more than PCT% faster, trains, and checks again.

Prints each run's layout, prediction, measured time and error, and writes results.json and the
logs under --out. --emulated runs 4 nodes x 1 process on tools/emucluster (root, iproute2, tc),
links shaped to --rate-mbit; otherwise 4 processes on this host, over loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

EXAMPLE = str(REPO / "examples" / "pretrain_gpt.py")
# A launch line written for GPUs: the hook supplies the CPU settings.
GPT = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
       "--seq-length", "256", "--max-position-embeddings", "256", "--untie-embeddings-and-output-weights",
       "--global-batch-size", "16", "--lr", "5e-3", "--min-lr", "5e-4", "--lr-decay-style", "cosine",
       "--lr-warmup-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
       "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000"]
NODES = 4


def launch(args: argparse.Namespace, name: str, cache: Path, extra: list[str]) -> str:
    """One job under --auto-parallel; returns every process's output."""
    line = [EXAMPLE, *GPT, "--auto-parallel", "--auto-parallel-cache-dir", str(cache),
            "--auto-parallel-budget-s", "90", "--train-iters", str(1 + args.check_iterations),
            "--auto-parallel-check-iterations", str(args.check_iterations), *extra]
    logdir = args.out / name
    t = time.monotonic()
    if args.emulated:
        from tools.emucluster import EmuCluster

        with EmuCluster({"nodes": NODES, "rate_mbit": args.rate_mbit}, tag=name[:4]) as cl:
            results = cl.torchrun(line, nproc_per_node=1, timeout=600, cwd=str(REPO), python=sys.executable,
                                  logdir=logdir)
        failed = [r for r in results if r.returncode != 0]
        out = "\n".join(r.output for r in results)
    else:
        logdir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(NODES), *line], cwd=REPO, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        out = proc.stdout + proc.stderr
        (logdir / "output.log").write_text(out)
        failed = [proc] if proc.returncode != 0 else []
    if failed:
        raise RuntimeError(f"{name} failed:\n{out[-4000:]}")
    print(f"{name}: {time.monotonic() - t:.0f} s", flush=True)
    return out


def mis_set(cluster_file: Path, kind: str, factor: float) -> None:
    """Multiply one level's bandwidths (one way and two-way) by `factor` (small files: nested lists)."""
    doc = json.loads(cluster_file.read_text())
    levels = [doc[kind]] if kind == "inter_node" else doc[kind]
    for level in levels:
        for key in ("bandwidth_Bps", "exchange_bandwidth_Bps"):
            if level.get(key) is not None:
                level[key] = [[None if v is None else v * factor for v in row] for row in level[key]]
    cluster_file.write_text(json.dumps(doc, indent=1))


def outcome(directory: Path, out: str) -> dict:
    doc = json.loads((directory / "plan.json").read_text())
    check = doc["self_check"]
    chosen = [line.split("chosen layout ", 1)[1].split(":")[0] for line in out.splitlines()
              if "> auto-parallel: chosen layout " in line][0]
    return {"layout": chosen, "node_order": doc["candidates"][0]["placement"]["node_order"],
            "predicted_s": check["predicted_s"], "measured_s": check["measured_s"],
            "error": check["measured_s"] / check["predicted_s"] - 1,
            "log": [line for line in out.splitlines() if "> auto-parallel: " in line and "groups" not in line]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "out" / "calibration_loop")
    p.add_argument("--emulated", action="store_true")
    p.add_argument("--rate-mbit", type=float, default=400.0)
    p.add_argument("--factor", type=float, default=0.25, help="multiplies the cached file's link bandwidths")
    p.add_argument("--replan-if-slower", type=float, default=5.0)
    p.add_argument("--check-iterations", type=int, default=4)
    args = p.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    cache = args.out / "cache"
    launch(args, "seed", cache, ["--auto-parallel-dry-run"])
    (directory,) = cache.iterdir()
    kind = "inter_node" if args.emulated else "intra_node"
    mis_set(directory / "cluster.json", kind, args.factor)
    (directory / "plan.json").unlink()
    runs = {}
    runs["A"] = outcome(directory, launch(args, "run-a", cache, []))
    shutil.copy(directory / "plan.json", args.out / "plan-a.json")
    shutil.copy(directory / "calibration.json", args.out / "calibration-a.json")
    runs["B"] = outcome(directory, launch(args, "run-b", cache,
                                          ["--auto-parallel-replan-if-slower", str(args.replan_if_slower)]))
    shutil.copy(directory / "plan.json", args.out / "plan-b.json")
    where = f"{NODES} emulated nodes at {args.rate_mbit:g} Mbit/s" if args.emulated else f"{NODES} processes, loopback"
    print(f"\n## Calibration loop: {where}, {kind} bandwidths in the cached cluster file x{args.factor:g}")
    print(f"{'run':>4} {'layout':>28} {'predicted s':>12} {'measured s':>11} {'error':>8}")
    for name, r in runs.items():
        print(f"{name:>4} {r['layout']:>28} {r['predicted_s']:12.3f} {r['measured_s']:11.3f} {r['error']:+8.1%}")
    for name, r in runs.items():
        print(f"\nrun {name}:\n  " + "\n  ".join(r["log"]))
    (args.out / "results.json").write_text(json.dumps({"emulated": args.emulated, "rate_mbit": args.rate_mbit,
                                                       "factor": args.factor, "kind": kind, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
