"""The in-job path on one GPU: `--auto-parallel` under torchrun on NCCL, then a cached restart and a
restart with `--load`.

    python -m benchmarks.validation.in_job --out DIR [--dry-run] [--budget-s S] [--iters N]
        [--megatron-lm DIR] [--first-only] [--pick-check MBS ...]

Why: the hook's probe on NCCL, its CUDA layer profile feeding the plan, the re-initialisation with
NCCL and the CUDA self-check have only run on CPU with gloo. Three starts of
`examples/pretrain_gpt.py` (and, with `--megatron-lm`, a first start of Megatron-LM's own
`pretrain_gpt.py` from that checkout, unmodified), each `torchrun --nproc-per-node 1`, the local spec,
mock data, the ~1.3B GPT of cost_check.py's train part:

1. first:  `--auto-parallel` with an empty cache, `--save`; probe, profile, plan, self-check;
2. cached: the same line again: the plan comes from the cache (no probe, no profile); the
           calibration the first start stored is used;
3. resume: `--load` of the first start's checkpoint: the job resumes at the saved iteration in the
           plan's layout and trains the last 10 iterations of the schedule.

`--pick-check 2 4` adds one start per micro-batch size with `--micro-batch-size` typed (the search
keeps it; the cache's probe and profile are reused): the planner's pick against measured
alternatives, each start's median step. `--first-only` runs the first start alone, without a save.

Each start's rows: exit code, the hook's `> auto-parallel:` lines (chosen layout, prediction,
phases, self-check: predicted and measured time and memory), the iteration times and losses, and
Megatron's memory report. `--dry-run` runs a tiny GPT on the CPU (gloo, the CPU rehearsal) to check
the script, about two minutes: its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

from benchmarks.validation.cost_check import (  # noqa: E402
    REPO,
    TRAIN_COMMON,
    TRAIN_MODEL,
    TRAIN_TINY,
    parse_megatron_log,
    run_megatron,
)

HOOK = re.compile(r"^.*?> auto-parallel: (.*)$", re.MULTILINE)
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")


def flags(dry_run: bool, iters: int, cache: Path, budget_s: float) -> list[str]:
    """The user's line: the model without a layout flag (the hook chooses it), and --auto-parallel."""
    model = (TRAIN_TINY if dry_run else TRAIN_MODEL).split()
    for layout_flag in ("--micro-batch-size",):   # left to the planner
        i = model.index(layout_flag)
        del model[i:i + 2]
    return [*model, *TRAIN_COMMON.split(), "--train-iters", str(iters), "--log-memory-interval", str(iters),
            "--auto-parallel", "--auto-parallel-cache-dir", str(cache), "--auto-parallel-budget-s", str(budget_s),
            *(["--distributed-backend", "gloo"] if dry_run else [])]


def start(name: str, script: Path, line: list[str], out: Path, limit_s: float) -> dict:
    """One torchrun start; its log in OUT/NAME.log and its rows."""
    log = out / f"{name}.log"
    t0 = time.monotonic()
    code = run_megatron(line, log, limit_s, script=script)
    text = log.read_text(errors="replace")
    got = parse_megatron_log(text, warmup=3)
    losses = {int(i): float(v) for i, v in LOSS.findall(text)}
    return {"name": name, "script": str(script.relative_to(REPO) if script.is_relative_to(REPO) else script),
            "flags": " ".join(line), "exit_code": code, "wall_s": round(time.monotonic() - t0, 1),
            "hook": HOOK.findall(text), "losses": [losses[i] for i in sorted(losses)],
            "first_iteration": min(losses) if losses else None, **got}


def summary(row: dict) -> list[str]:
    """The lines a person reads first: exit, layout, prediction, self-check, phases, the measured step."""
    keep = ("chosen layout", "predicted", "self-check", "phases", "using the plan", "resuming", "calibrat",
            "WARNING", "failed", "planning")
    lines = [f"{row['name']}: exit {row['exit_code']} after {row['wall_s']} s; iterations from "
             f"{row['first_iteration']}, median step {row['step_s']} s, max allocated {row['max_allocated_bytes']}"]
    lines += [f"  {h}" for h in row["hook"] if any(k in h for k in keep)]
    if row["losses"]:
        lines.append(f"  loss {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f} over {len(row['losses'])} iterations")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder: in_job.json, each start's log, cache, ckpt")
    p.add_argument("--dry-run", action="store_true", help="tiny GPT on the CPU, to check the script")
    p.add_argument("--iters", type=int, default=30, help="iterations of the first and cached starts")
    p.add_argument("--budget-s", type=float, default=90.0, help="--auto-parallel-budget-s of each start")
    p.add_argument("--limit-s", type=float, default=150.0, help="hard limit of each start")
    p.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout whose pretrain_gpt.py also runs once")
    p.add_argument("--first-only", action="store_true", help="the first start alone, without --save")
    p.add_argument("--pick-check", type=int, nargs="+", default=[], metavar="MBS",
                   help="one more start per micro-batch size, typed: the pick against measured alternatives")
    ns = p.parse_args(argv)
    out = ns.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache, ckpt, example = out / "cache", out / "ckpt", REPO / "examples" / "pretrain_gpt.py"
    # One schedule of ITERS + 10 iterations (Megatron's LR scheduler refuses a resume whose
    # --train-iters differs from the checkpoint's): the first starts stop at ITERS (--exit-interval,
    # which also saves), the resume trains the last 10.
    line = flags(ns.dry_run, ns.iters + 10, cache, ns.budget_s)
    stop = ["--exit-interval", str(ns.iters)]
    save = [] if ns.first_only else ["--save", str(ckpt), "--save-interval", str(ns.iters)]
    plan = [("first", example, line + stop + save)]
    if not ns.first_only:
        plan += [("cached", example, line + stop), ("resume", example, line + ["--load", str(ckpt)])]
    plan += [(f"mbs{m}", example, line + stop + ["--micro-batch-size", str(m)]) for m in ns.pick_check]
    if ns.megatron_lm is not None:
        plan.append(("megatron_lm", ns.megatron_lm / "pretrain_gpt.py",
                     flags(ns.dry_run, ns.iters + 10, out / "cache-megatron-lm", ns.budget_s) + stop))
    doc: dict = {"starts": []}
    for name, script, args in plan:
        row = start(name, script, args, out, ns.limit_s)
        doc["starts"].append(row)
        (out / "in_job.json").write_text(json.dumps(doc, indent=1) + "\n")
        print("\n".join(summary(row)), flush=True)
    first = doc["starts"][0]
    resumed = next((r for r in doc["starts"] if r["name"] == "resume"), None)
    if resumed and first["losses"] and resumed["losses"]:
        print(f"resume: first start ended at iteration {len(first['losses'])} loss {first['losses'][-1]:.4f}; "
              f"the resumed job starts at iteration {resumed['first_iteration']} loss {resumed['losses'][0]:.4f}")
    if ns.pick_check:
        print("the pick against typed micro-batches (median step, s): " + ", ".join(
            f"{r['name']} {r['step_s']}" for r in doc["starts"] if r["name"] == "first" or r["name"].startswith("mbs")))
    steps = [r["step_s"] for r in doc["starts"] if r["step_s"]]
    if steps:
        print(f"median step over the starts: {statistics.median(steps):.4g} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
