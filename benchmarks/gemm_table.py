"""Fit the planner's GEMM efficiency table from measured GEMMs, and score it on held-out shapes.

    python benchmarks/gemm_table.py [--write] [--out benchmarks/results/gemm_table-DATE]

Why: the planner prices a GEMM at the device's large-GEMM rate (cluster.gemm_flops, the rate of
an 8192^3 GEMM, which the probe measures) times the fraction of it that GEMM's shape attains.
That fraction comes from a table measured per GPU (megatron_pipette/data/gemm_efficiency.json,
read by cost.compute.gemm_curve), not from a constant. This script builds the table.

Input: the H100 runs of benchmarks/gemm_efficiency.py (RUNS below): 9,070 timed bf16 and fp8
GEMMs, 7,136 distinct (m, n, k, operand layout, dtype), the GEMMs of the transformer layers of
24 models of hidden size 1024-25600 at TP 1-8 and 2048-16384 tokens, in their forward, data-
and weight-gradient orientations. A GEMM's value is its rate over its own run's 8192^3 rate
(`vs_reference`), the geometric mean where a shape was timed more than once.

Method: the distinct shapes are split once, by a fixed seed (SPLIT_SEED), into a fit set
(75%) and a held-out set (25%). Per dtype, the table holds log(efficiency) on a grid of
log2(m), log2(n), log2(k) from 2^7 to 2^18 (12 nodes an axis), read by trilinear interpolation
(shapes beyond the grid are clamped to its edge). The nodes are the least-squares fit of the
fit set's log efficiencies plus LAMBDA x the second differences along each axis (a smoothness
penalty that also fills nodes no shape reaches, by extrapolating linearly in log-log); LAMBDA is
chosen on a validation quarter of the fit set, then the table is refitted on the whole fit set.
Node values are clamped to the range measured. The operand layout is not a table axis: its mean
residual is under 0.5% either way. For GPUs without a table, the parametric curve
prod over m, n, k of x / (x + c) is used, with c fitted (least squares in log) on the same fit
set. Both are scored on the held-out set: mean, median, 90th percentile and worst |relative error|.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RUNS = [ROOT / "benchmarks/results/h100-2026-11-23-run1/gemm_efficiency.json",
        ROOT / "benchmarks/results/h100-2026-11-23-run2/gemm_efficiency.json"]
TABLE = ROOT / "megatron_pipette/data/gemm_efficiency.json"
SPLIT_SEED = 0
HELD_OUT_FRACTION = 0.25
LOG2_RANGE = (7, 18)
LAMBDAS = (0.1, 0.3, 1.0, 3.0)
HALF_DIMS = np.arange(0, 1025, 4)


def load(paths: list[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple]]:
    """(dims (N, 3), log efficiency (N,), dtype (N,), keys) of the distinct timed shapes."""
    seen: dict[tuple, list[float]] = {}
    for path in paths:
        for r in json.loads(path.read_text())["rows"]:
            if "vs_reference" in r and r["vs_reference"]:
                seen.setdefault((r["m"], r["n"], r["k"], r["layout"], r["dtype"]), []).append(np.log(r["vs_reference"]))
    keys = sorted(seen)
    dims = np.array([k[:3] for k in keys], dtype=float)
    return dims, np.array([np.mean(seen[k]) for k in keys]), np.array([k[4] for k in keys]), keys


def interpolation(dims: np.ndarray) -> np.ndarray:
    """(N, g^3) trilinear weights of each shape on the log2 grid (the planner's lookup, as a matrix)."""
    lo, hi = LOG2_RANGE
    g = hi - lo + 1
    u = np.clip(np.log2(dims), lo, hi) - lo
    i = np.minimum(np.floor(u).astype(int), g - 2)
    f = u - i
    out = np.zeros((len(dims), g ** 3))
    for corner in np.ndindex(2, 2, 2):
        w = np.prod([f[:, a] if c else 1 - f[:, a] for a, c in enumerate(corner)], axis=0)
        flat = np.ravel_multi_index(tuple(i[:, a] + c for a, c in enumerate(corner)), (g, g, g))
        np.add.at(out, (np.arange(len(dims)), flat), w)
    return out


def second_differences() -> np.ndarray:
    """(rows, g^3): the second difference of the node values along each axis, at every interior node."""
    g = LOG2_RANGE[1] - LOG2_RANGE[0] + 1
    rows = []
    for axis in range(3):
        for node in np.ndindex(g, g, g):
            if 0 < node[axis] < g - 1:
                r = np.zeros(g ** 3)
                for step, c in ((-1, 1.0), (0, -2.0), (1, 1.0)):
                    n = list(node)
                    n[axis] += step
                    r[np.ravel_multi_index(tuple(n), (g, g, g))] = c
                rows.append(r)
    return np.array(rows)


def fit_grid(a: np.ndarray, y: np.ndarray, smooth: np.ndarray, lam: float) -> np.ndarray:
    """Node values minimising |a x - y|^2 + lam^2 |smooth x|^2 (normal equations)."""
    return np.linalg.solve(a.T @ a + lam ** 2 * smooth.T @ smooth, a.T @ y)


def fit_half_dim(dims: np.ndarray, y: np.ndarray) -> int:
    """c of prod x / (x + c) best fitting the log efficiencies."""
    sse = [((np.log(dims / (dims + c)).sum(axis=1) - y) ** 2).sum() for c in HALF_DIMS]
    return int(HALF_DIMS[int(np.argmin(sse))])


def errors(predicted_log: np.ndarray, y: np.ndarray) -> dict[str, float]:
    e = np.abs(np.expm1(predicted_log - y))
    return {"shapes": len(e), "mean": round(float(e.mean()), 4), "median": round(float(np.median(e)), 4),
            "p90": round(float(np.quantile(e, 0.9)), 4), "worst": round(float(e.max()), 4)}


def compact_json(doc: dict) -> str:
    """JSON with every list of numbers on one line (a table row), the rest indented."""
    text = json.dumps(doc, indent=1)
    return re.sub(r"\[\s+([-0-9.e,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"rewrite the tables in {TABLE.relative_to(ROOT)}")
    p.add_argument("--out", help="folder for results.json (fit and held-out errors)")
    ns = p.parse_args(argv)
    dims, y, dtype, keys = load(RUNS)
    rng = np.random.default_rng(SPLIT_SEED)
    held = rng.random(len(y)) < HELD_OUT_FRACTION
    validation = rng.random(len(y)) < 0.25                      # a quarter of the fit set picks lambda
    a, smooth = interpolation(dims), second_differences()
    g = LOG2_RANGE[1] - LOG2_RANGE[0] + 1
    report: dict = {"date": datetime.date.today().isoformat(), "runs": [str(r.relative_to(ROOT)) for r in RUNS],
                    "split_seed": SPLIT_SEED, "held_out_fraction": HELD_OUT_FRACTION, "dtypes": {}}
    tables, half_dims = {}, {}
    for dt in sorted(set(dtype)):
        sel = dtype == dt
        fit, out = sel & ~held, sel & held
        train, check = fit & ~validation, fit & validation
        scores = {lam: errors(a[check] @ fit_grid(a[train], y[train], smooth, lam), y[check])["mean"]
                  for lam in LAMBDAS}
        lam = min(scores, key=scores.get)
        nodes = np.clip(fit_grid(a[fit], y[fit], smooth, lam), y[sel].min(), y[sel].max())
        c = fit_half_dim(dims[fit], y[fit])
        curve = np.log(dims / (dims + c)).sum(axis=1)
        tables[dt] = np.round(np.exp(nodes), 3).reshape(g, g, g)
        half_dims[dt] = c
        rounded = a @ np.log(tables[dt].reshape(-1))
        report["dtypes"][dt] = {
            "shapes": int(sel.sum()), "fit_shapes": int(fit.sum()), "held_out_shapes": int(out.sum()),
            "lambda": lam, "lambda_validation_mean_error": scores,
            "table": {"fit": errors(rounded[fit], y[fit]), "held_out": errors(rounded[out], y[out])},
            "half_dim": c, "parametric": {"fit": errors(curve[fit], y[fit]), "held_out": errors(curve[out], y[out])}}
        for name in ("table", "parametric"):
            r = report["dtypes"][dt][name]
            print(f"{dt} {name:>10}: fit mean {r['fit']['mean']:.1%} median {r['fit']['median']:.1%}; held out "
                  f"mean {r['held_out']['mean']:.1%} median {r['held_out']['median']:.1%} p90 "
                  f"{r['held_out']['p90']:.1%} worst {r['held_out']['worst']:.0%} ({r['held_out']['shapes']} shapes)")
        print(f"{dt}: lambda {lam}, half_dim {c}")
    if ns.write:
        doc = json.loads(TABLE.read_text())
        doc["half_dim"] = half_dims
        doc["gpus"]["H100-80GB"]["tables"] = {dt: t.tolist() for dt, t in tables.items()}
        TABLE.write_text(compact_json(doc))
    if ns.out:
        Path(ns.out).mkdir(parents=True, exist_ok=True)
        (Path(ns.out) / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
