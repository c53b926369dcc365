"""Fit the time model's execution constants on the development set of published H100 runs only.

    python -m benchmarks.calibration.fit_execution [--out benchmarks/results/fit_execution-DATE]

Why: three costs of a real training step have no kernel table to read them from (cost.execution):
the share of the GEMM tables' rate a step's GEMMs get (GPU.step_gemm_fraction), the compute an
overlapped NCCL collective takes (Execution.nccl_compute_share), and an MoE layer's fixed cost
(Execution.moe_layer_fixed_s). Each is scanned over its physical range only (cost.execution gives
the bounds: a collective holds at least its channels' SMs, an MoE layer at least its small collectives), by grid
search on the mean |error| of benchmarks/validation/published_runs_h100.py's rows
priced with their recipes; the runs kept apart are never seen here. The dense rows decide the first
two, on a joint grid (they trade against each other), the MoE rows then the third.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.validation.published_runs_h100 import DATA, is_moe, pinned
from megatron_pipette.cost.execution import Execution

STEP_FRACTIONS = [round(0.80 + 0.02 * i, 2) for i in range(11)]        # 0.80-1.00: at most the tables' rate
SHARE = [round(0.10 + 0.05 * i, 2) for i in range(5)]               # 0.10-0.30: NCCL's SMs and HBM traffic
HOST_S = [round(1e-4 * i, 4) for i in (1, 2, 3, 5, 7, 10, 13, 16, 20)]  # 0.1-2 ms a layer


def score(rows: list[dict], step_fraction: float, execution: Execution) -> tuple[float, list[float]]:
    errors = [pinned(r, recipe=True, execution=execution, step_fraction=step_fraction).get("error", np.nan)
              for r in rows]
    return float(np.nanmean(np.abs(errors))), errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for results.json")
    ns = p.parse_args(argv)
    rows = json.loads(DATA.read_text())["rows"]
    dense, moe = [r for r in rows if not is_moe(r)], [r for r in rows if is_moe(r)]
    grid = {(su, c): score(dense, su, Execution(nccl_compute_share=c))[0] for su in STEP_FRACTIONS for c in SHARE}
    step_fraction, share = min(grid, key=grid.get)
    execution = Execution(nccl_compute_share=share)
    scores = {h: score(moe, step_fraction, dataclasses.replace(execution, moe_layer_fixed_s=h))[0] for h in HOST_S}
    execution = dataclasses.replace(execution, moe_layer_fixed_s=min(scores, key=scores.get))
    trace = {"dense_grid": {f"{su} {c}": v for (su, c), v in grid.items()}, "moe_layer_fixed_s": scores}
    print(f"step GEMM fraction {step_fraction}, {execution}", flush=True)
    total, errors = score(rows, step_fraction, execution)
    print(f"all {len(rows)} rows: mean |error| {total:.1%}, signed {np.nanmean(errors):+.1%}")
    for r, e in zip(rows, errors):
        print(f"  {r['id']:<26} {e:+.1%}")
    if ns.out:
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(
            {"date": datetime.date.today().isoformat(), "step_gemm_fraction": step_fraction,
             "execution": dataclasses.asdict(execution), "trace": trace,
             "errors": {r["id"]: e for r, e in zip(rows, errors)}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
