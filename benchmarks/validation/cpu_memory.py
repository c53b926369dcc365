"""The memory model's terms against the tensors counted in CPU rehearsal, per pipeline stage.

    python -m benchmarks.validation.cpu_memory [--out benchmarks/results/cpu_memory-DATE]

Why: on CPU there is no allocator to ask for a peak, but the terms that do not depend on one can
be counted. Each layout trains the tiny GPT of examples/auto_parallel_cpu.sh (4 gloo processes)
under --auto-parallel with its layout flags given; the self-check counts, on every rank, the
bytes of the tensors alive between steps (model state: weights, gradient buffers, optimizer
state) and the most bytes the first step's forward passes held for backward at once
(activations), and records them in the cached plan beside the plan's own terms. Printed: per
layout and stage, predicted and counted MiB and their ratio, the largest count over the stage's
ranks. Transient bytes (inside one pass) and overheads (allocator, CUDA context, NCCL) are not
countable this way and are not compared. Three sets: LAYOUTS, whose counts were looked at while
fixing the model, UNSEEN and UNSEEN_2, each written before a run and scored (UNSEEN's MoE layout
was then looked at). The layouts' logs and results.json go under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "auto_parallel_cpu.sh"
TERMS = ("model state", "activations")
LAYOUTS = {
    "tp1-pp1-dp4-mbs4": ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                         "--micro-batch-size", "4"],
    "tp1-pp4-dp1-mbs1": ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
                         "--micro-batch-size", "1"],
    "tp1-pp2-dp2-mbs2-lpv1": ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                              "--micro-batch-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    "tp2-pp2-dp1-mbs2-full-recompute": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                        "--micro-batch-size", "2", "--recompute-granularity", "full",
                                        "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "tp2-pp1-dp2-mbs4-dopt-selective": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                                        "--micro-batch-size", "4", "--use-distributed-optimizer",
                                        "--recompute-granularity", "selective"],
    "moe-ep2-tp1-pp2-mbs1": ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                             "--swiglu", "--disable-bias-linear",
                             "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                             "--micro-batch-size", "1"],
}
"""Looked at: their first counts led to three fixes (an interleaved end rank's chunk 0 and last
chunk weighed at their own size; the example's MoE layers; the refusal of --sequence-parallel
without Transformer Engine or apex, which a TP 2 SP layout of the first run met: it cannot run
in CPU rehearsal). Megatron's MoE experts need SwiGLU without biases (its fused weighted
activation), as Mixtral-like models have them."""
UNSEEN = {
    "l6-tp1-pp2-dp2-mbs1-lpv2-emb-loss": ["--num-layers", "6", "--tensor-model-parallel-size", "1",
                                          "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
                                          "--num-layers-per-virtual-pipeline-stage", "2",
                                          "--account-for-embedding-in-pipeline-split",
                                          "--account-for-loss-in-pipeline-split"],
    "l6-tp2-pp2-dp1-mbs2-lpv2-emb-loss-selective": ["--num-layers", "6", "--tensor-model-parallel-size", "2",
                                                    "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                                                    "--num-layers-per-virtual-pipeline-stage", "2",
                                                    "--account-for-embedding-in-pipeline-split",
                                                    "--account-for-loss-in-pipeline-split",
                                                    "--recompute-granularity", "selective"],
    "l7-tp1-pp2-dp2-mbs1-lpv1-emb": ["--num-layers", "7", "--tensor-model-parallel-size", "1",
                                     "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
                                     "--num-layers-per-virtual-pipeline-stage", "1",
                                     "--account-for-embedding-in-pipeline-split"],
    "l8-tp1-pp4-dp1-mbs2": ["--num-layers", "8", "--tensor-model-parallel-size", "1",
                            "--pipeline-model-parallel-size", "4", "--micro-batch-size", "2"],
    "l8-tp1-pp2-dp2-mbs2-full-block2": ["--num-layers", "8", "--tensor-model-parallel-size", "1",
                                        "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                                        "--recompute-granularity", "full", "--recompute-method", "block",
                                        "--recompute-num-layers", "2"],
    "moe-ep4-tp1-pp1-dp4-mbs2": ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "4",
                                 "--swiglu", "--disable-bias-linear", "--tensor-model-parallel-size", "1",
                                 "--pipeline-model-parallel-size", "1", "--micro-batch-size", "2"],
    "tp2-pp1-dp2-mbs1-dopt": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                              "--micro-batch-size", "1", "--use-distributed-optimizer"],
}
"""Written after those fixes and before any of them ran: scored. Their one MoE layout's count then
led to a fourth fix (without Transformer Engine's spec the attention keeps its scores, which the
MoE layers' formula had left out), so from then on it counts as looked at."""
UNSEEN_2 = {
    "moe-ep2-tp2-pp1-dp1-mbs1-alltoall": ["--num-experts", "4", "--moe-router-topk", "2",
                                          "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                                          "alltoall", "--swiglu", "--disable-bias-linear",
                                          "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                                          "--micro-batch-size", "1"],
    "moe-e8-ep2-tp1-pp2-dp1-mbs2": ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size",
                                    "2", "--swiglu", "--disable-bias-linear", "--tensor-model-parallel-size", "1",
                                    "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2"],
    "moe-l6-freq2-ep4-pp1-dp4-mbs1": ["--num-layers", "6", "--num-experts", "4", "--moe-layer-freq", "2",
                                      "--expert-model-parallel-size", "4", "--swiglu", "--disable-bias-linear",
                                      "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                                      "--micro-batch-size", "1"],
}
"""Written after the fourth fix and before any of them ran: scored only."""


def run(name: str, flags: list[str], out: Path, which: str) -> dict:
    cache = out / "cache" / name
    shutil.rmtree(cache, ignore_errors=True)      # a fresh plan, probe and profile for every run
    proc = subprocess.run(["bash", str(SCRIPT), "--train-iters", "8", *flags], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PIPETTE_CACHE_DIR": str(cache)}, cwd=REPO)
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"layout": name, "set": which, "flags": flags, "failed": (proc.stdout + proc.stderr)[-2000:]}
    (plan_file,) = cache.glob("*/plan.json")
    doc = json.loads(plan_file.read_text())
    check = doc["self_check"]
    return {"layout": name, "set": which, "flags": flags, "chosen": doc["candidates"][0]["layout"],
            "stages": [{"stage": s["stage"], "ranks": s["ranks"], "predicted": s["predicted_tensors"],
                        "counted": s["measured_tensors"]} for s in check["stages"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "cpu_memory")
    sets = {"looked": LAYOUTS, "unseen-1": UNSEEN, "unseen-2": UNSEEN_2}
    parser.add_argument("--set", choices=[*sets, "all"], default="all", help="which layouts")
    ns = parser.parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    rows = [run(name, flags, ns.out, which) for which, layouts in sets.items() if ns.set in (which, "all")
            for name, flags in layouts.items()]
    print(f"{'layout':44} {'set':>8} {'stage':>5} " + " ".join(f"{t + ' MiB pred/counted':>30}" for t in TERMS))
    ratios = {(w, t): [] for w in sets for t in TERMS}
    for row in rows:
        if "failed" in row:
            print(f"{row['layout']:44} FAILED: {row['failed'][-300:]}")
            continue
        for s in row["stages"]:
            cells = []
            for t in TERMS:
                p, c = s["predicted"][t], s["counted"][t]
                ratios[row["set"], t].append(c / p)
                cells.append(f"{p / 2**20:10.3f} / {c / 2**20:8.3f} ({c / p:5.2f}x)")
            print(f"{row['layout']:44} {row['set']:>8} {s['stage']:>5} " + " ".join(f"{c:>30}" for c in cells))
    for (which, t), r in ratios.items():
        if r:
            r = sorted(r)
            print(f"{which} {t}: counted/predicted over {len(r)} stages: min {r[0]:.3f}, median "
                  f"{r[len(r) // 2]:.3f}, max {r[-1]:.3f}")
    failed = [r["layout"] for r in rows if "failed" in r]
    print(f"{len(rows) - len(failed)} of {len(rows)} layouts trained" + (f"; failed: {failed}" if failed else ""))
    (ns.out / "results.json").write_text(json.dumps({"rows": rows, "python": sys.version}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
