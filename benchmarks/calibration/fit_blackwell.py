"""Fit each Blackwell GPU's step GEMM fraction on the development set of published Blackwell runs only.

    python -m benchmarks.calibration.fit_blackwell [--out benchmarks/results/fit_blackwell-DATE]

Why: no Blackwell GEMM was measured, so the catalog prices a Blackwell step from assumptions (an
8192^3 GEMM at 0.75 of the dense datasheet peak, the H100's GEMM shape curve: data/gpus.json's
_about), and the published runs price too fast on some GPUs: the same datasheet FP8 peak (5 PFLOP/s)
for the GB200 at 1200 W and the GB300 at 1400 W, where the runs say they differ. GPU.step_gemm_fraction
is the share of its tables' rate a step's GEMMs get (fit_execution fits the H100's); here one per
Blackwell GPU, each on its own GPU's dense rows, scanned over its physical range (0.80-1.00: at most
the tables' rate) by grid search on the mean |error| of the rows priced with their recipes. Left out
of the fit: the MoE rows, whose per-layer costs the releases changed at one layout (release_steps:
Qwen3-30B-A3B's rows jump 49-72% at 26.06, and an MoE layer's fixed cost, which a CUDA graph removes,
fits the earlier releases and not the later), so that a GEMM share would stand in for them; the rows
whose error release_steps explains at a fraction of 1; and the rows it cannot price or whose
settings are not known. What it absorbs: the assumed 0.75 and whatever else a Blackwell step loses
to its GEMMs, together; it is a fit, not a measurement.

To say how well it carries to models it has not seen, each model's rows are also priced with the
fraction fitted on the other models' rows (leave one model out): the held-out figure. A fraction is
adopted (data/gpus.json) only where that figure beats the unfitted one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import numpy as np

from benchmarks.kept import keep
from benchmarks.validation.published_runs_blackwell import DATA, as_h100_row, not_known
from benchmarks.validation.published_runs_h100 import is_moe, pinned
from benchmarks.validation.release_steps import explanations

STEP_FRACTIONS = [round(0.80 + 0.02 * i, 2) for i in range(11)]        # 0.80-1.00: at most the tables' rate


def model_of(row: dict) -> str:
    return row["label"].split()[1]


def errors(rows: list[dict], fraction: float) -> list[float]:
    return [pinned(as_h100_row(r), recipe=True, step_fraction=fraction)["error"] for r in rows]


def best(grid: dict[float, list[float]], keep: list[bool]) -> float:
    """The fraction with the least mean |error| over the rows `keep` marks (the first of equals)."""
    return min(grid, key=lambda f: np.mean([abs(e) for e, k in zip(grid[f], keep) if k]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for results.json")
    ns = p.parse_args(argv)
    every = json.loads(DATA.read_text())["rows"]
    # Which rows to leave out is decided before any fit (every GPU's fraction at 1), so that a refit
    # with fitted values in the catalog sees the same rows.
    unfitted = [{"recipe": pinned(as_h100_row(r), recipe=True, step_fraction=1.0)} for r in every]
    why = explanations(every, [as_h100_row(r) for r in every], unfitted)
    rows = [r for r, res, w in zip(every, unfitted, why)
            if "error" in res["recipe"] and w is None and not not_known(r, res["recipe"].get("error_message"))
            and not is_moe(as_h100_row(r))]
    out = {"date": datetime.date.today().isoformat(), "grid": STEP_FRACTIONS, "gpus": {}}
    for cluster in sorted({r["cluster"] for r in rows}):
        mine = [r for r in rows if r["cluster"] == cluster]
        grid = {f: errors(mine, f) for f in STEP_FRACTIONS}
        fitted = best(grid, [True] * len(mine))
        models = sorted({model_of(r) for r in mine})
        held = {}
        for model in models:
            other = [model_of(r) != model for r in mine]
            f = best(grid, other) if any(other) else None
            if f is not None:
                held.update({r["id"]: grid[f][i] for i, r in enumerate(mine) if not other[i]})
        before = float(np.mean(np.abs(grid[1.0])))
        held_mean = float(np.mean(np.abs(list(held.values())))) if held else None
        adopted = fitted != 1.0 and held_mean is not None and held_mean < before
        print(f"{cluster}: {len(mine)} rows of {len(models)} models, step GEMM fraction {fitted} (mean |error| "
              f"{before:.1%} at 1.00, {np.mean(np.abs(grid[fitted])):.1%} fitted, signed {np.mean(grid[fitted]):+.1%}; "
              + (f"each model priced with the other models' fit: {held_mean:.1%})" if held_mean is not None
                 else "one model: nothing to hold out)")
              + ("" if adopted or fitted == 1.0 else ": not adopted, it does not carry to models it was not fitted on"),
              flush=True)
        out["gpus"][cluster] = {"step_gemm_fraction": fitted, "adopted": adopted, "rows": [r["id"] for r in mine],
                                "mean_abs_error": {str(f): float(np.mean(np.abs(e))) for f, e in grid.items()},
                                "errors_fitted": {r["id"]: e for r, e in zip(mine, grid[fitted])},
                                "held_out_by_model": held}
    if ns.out:
        keep(ns.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
