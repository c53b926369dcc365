"""Fit the planner's GEMM efficiency table from measured GEMMs, and score it on held-out shapes.

    python -m benchmarks.calibration.gemm_table [--write] [--out benchmarks/results/gemm_table-DATE]

Why: the planner prices a GEMM at the device's large-GEMM rate (cluster.gemm_flops, the rate of
an 8192^3 GEMM, which the probe measures) times the fraction of it that GEMM's shape attains.
That fraction comes from a table measured per GPU (megatron_pipette/data/gemm_efficiency.json,
read by cost.gemm.gemm_curve), not from a constant. This script builds the table.

Input: the H100 runs of benchmarks/calibration/gemm_efficiency.py (RUNS below): 9,070 timed bf16 and fp8
GEMMs, 7,136 distinct (m, n, k, operand layout, dtype), the GEMMs of the transformer layers of
24 models of hidden size 1024-25600 at TP 1-8 and 2048-16384 tokens, in their forward, data-
and weight-gradient orientations. A GEMM's value is its rate over its own run's 8192^3 rate
(`vs_reference`), the geometric mean where a shape was timed more than once.

The attention tables come the same way from the causal attention timings (RUNS' attention.json,
torch SDPA with the cuDNN and flash backends): per kernel and direction, log efficiency (the
FLOPs the causal kernel does, half the full s^2 count, over its time and the 8192^3 rate) on a
log2 grid of one call's FLOPs, 2^30-2^45, fitted like the GEMM table with the same split of rows.

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

ROOT = Path(__file__).resolve().parents[2]
RUNS = [ROOT / "benchmarks/results/h100-2026-11-23-run1/gemm_efficiency.json",
        ROOT / "benchmarks/results/h100-2026-11-23-run2/gemm_efficiency.json"]
ATTENTION = ROOT / "benchmarks/results/h100-2026-11-23-run1/attention.json"
TABLE = ROOT / "megatron_pipette/data/gemm_efficiency.json"
SPLIT_SEED = 0
HELD_OUT_FRACTION = 0.25
LOG2_RANGE = (7, 18)
ATTENTION_LOG2_RANGE = (30, 45)
"""log2 of one causal attention call's FLOPs: the attention tables' nodes."""
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


def interpolation(log2_coords: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """(N, g^D) multilinear weights of each point (log2 coordinates, (N, D)) on the grid of nodes
    lo..hi along each axis: the planner's lookup, as a matrix."""
    n, axes = log2_coords.shape
    g = hi - lo + 1
    u = np.clip(log2_coords, lo, hi) - lo
    i = np.minimum(np.floor(u).astype(int), g - 2)
    f = u - i
    out = np.zeros((n, g ** axes))
    for corner in np.ndindex(*(2,) * axes):
        w = np.prod([f[:, a] if c else 1 - f[:, a] for a, c in enumerate(corner)], axis=0)
        flat = np.ravel_multi_index(tuple(i[:, a] + c for a, c in enumerate(corner)), (g,) * axes)
        np.add.at(out, (np.arange(n), flat), w)
    return out


def second_differences(g: int, axes: int) -> np.ndarray:
    """(rows, g^D): the second difference of the node values along each axis, at every interior node."""
    rows = []
    for axis in range(axes):
        for node in np.ndindex(*(g,) * axes):
            if 0 < node[axis] < g - 1:
                r = np.zeros(g ** axes)
                for step, c in ((-1, 1.0), (0, -2.0), (1, 1.0)):
                    n = list(node)
                    n[axis] += step
                    r[np.ravel_multi_index(tuple(n), (g,) * axes)] = c
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


def fit_table(a: np.ndarray, smooth: np.ndarray, y: np.ndarray, sel: np.ndarray, held: np.ndarray,
              validation: np.ndarray) -> tuple[np.ndarray, dict]:
    """Node values (efficiency, 3 digits) fitted on the selected points outside the held-out set,
    lambda picked on the validation part of the fit set; and the fit and held-out errors."""
    fit, out = sel & ~held, sel & held
    train, check = fit & ~validation, fit & validation
    scores = {lam: errors(a[check] @ fit_grid(a[train], y[train], smooth, lam), y[check])["mean"] for lam in LAMBDAS}
    lam = min(scores, key=scores.get)
    table = np.round(np.exp(np.clip(fit_grid(a[fit], y[fit], smooth, lam), y[sel].min(), y[sel].max())), 3)
    rounded = a @ np.log(table)
    return table, {"points": int(sel.sum()), "fit_points": int(fit.sum()), "held_out_points": int(out.sum()),
                   "lambda": lam, "lambda_validation_mean_error": scores,
                   "table": {"fit": errors(rounded[fit], y[fit]), "held_out": errors(rounded[out], y[out])}}


def print_errors(name: str, r: dict) -> None:
    print(f"{name:>24}: fit mean {r['fit']['mean']:.1%} median {r['fit']['median']:.1%}; held out "
          f"mean {r['held_out']['mean']:.1%} median {r['held_out']['median']:.1%} p90 "
          f"{r['held_out']['p90']:.1%} worst {r['held_out']['worst']:.0%} ({r['held_out']['shapes']} points)")


def gemm_tables(report: dict) -> tuple[dict, dict]:
    """The GEMM table and the parametric constant per dtype."""
    dims, y, dtype, _ = load(RUNS)
    rng = np.random.default_rng(SPLIT_SEED)
    held = rng.random(len(y)) < HELD_OUT_FRACTION
    validation = rng.random(len(y)) < 0.25                      # a quarter of the fit set picks lambda
    a, smooth = interpolation(np.log2(dims), *LOG2_RANGE), second_differences(LOG2_RANGE[1] - LOG2_RANGE[0] + 1, 3)
    g = LOG2_RANGE[1] - LOG2_RANGE[0] + 1
    tables, half_dims = {}, {}
    for dt in sorted(set(dtype)):
        sel = dtype == dt
        table, result = fit_table(a, smooth, y, sel, held, validation)
        fit, out = sel & ~held, sel & held
        c = fit_half_dim(dims[fit], y[fit])
        curve = np.log(dims / (dims + c)).sum(axis=1)
        tables[dt], half_dims[dt] = table.reshape(g, g, g), c
        report["gemm"][dt] = {**result, "half_dim": c,
                              "parametric": {"fit": errors(curve[fit], y[fit]), "held_out": errors(curve[out], y[out])}}
        print_errors(f"GEMM {dt} table", result["table"])
        print_errors(f"GEMM {dt} x/(x+{c})", report["gemm"][dt]["parametric"])
    return tables, half_dims


def attention_tables(report: dict) -> dict:
    """Per kernel (cudnn, flash), forward and backward efficiency over log2 of one call's FLOPs."""
    rows = [r for r in json.loads(ATTENTION.read_text())["rows"] if "forward_s" in r]
    ref = json.loads(ATTENTION.read_text())["meta"]["reference_bf16_flops"]
    rng = np.random.default_rng(SPLIT_SEED)
    held_rows = rng.random(len(rows)) < HELD_OUT_FRACTION
    validation_rows = rng.random(len(rows)) < 0.25
    smooth = second_differences(ATTENTION_LOG2_RANGE[1] - ATTENTION_LOG2_RANGE[0] + 1, 1)
    tables: dict = {}
    for kernel in ("cudnn", "flash"):
        for direction, key, factor in (("forward", "forward_s", 1), ("backward", "backward_s", 2)):
            sel = np.array([r["backend"] == kernel for r in rows])
            flops = np.array([factor * causal_flops(r) for r in rows])
            y = np.log(np.array([f / r[key] / ref for f, r in zip(flops, rows)]))
            a = interpolation(np.log2(flops)[:, None], *ATTENTION_LOG2_RANGE)
            table, result = fit_table(a, smooth, y, sel, held_rows, validation_rows)
            tables.setdefault(kernel, {})[direction] = table.tolist()
            report["attention"][f"{kernel} {direction}"] = result
            print_errors(f"attention {kernel} {direction}", result["table"])
    return tables


def causal_flops(row: dict) -> float:
    """FLOPs of one causal attention forward call, half the full 4 b h s^2 d (the masked half skipped)."""
    return 2.0 * row["b"] * row["heads"] * row["s"] ** 2 * row["head_dim"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"rewrite the tables in {TABLE.relative_to(ROOT)}")
    p.add_argument("--out", help="folder for results.json (fit and held-out errors)")
    ns = p.parse_args(argv)
    report: dict = {"date": datetime.date.today().isoformat(),
                    "runs": [str(r.relative_to(ROOT)) for r in RUNS + [ATTENTION]], "split_seed": SPLIT_SEED,
                    "held_out_fraction": HELD_OUT_FRACTION, "gemm": {}, "attention": {}}
    tables, half_dims = gemm_tables(report)
    attention = attention_tables(report)
    if ns.write:
        doc = json.loads(TABLE.read_text())
        doc["half_dim"] = half_dims
        doc["attention_log2_flops_range"] = list(ATTENTION_LOG2_RANGE)
        # No shape beats the large GEMM's own rate: a node fitted above 1 (short bursts, L2 hits) is
        # clamped, as cost.gemm.GemmCurve clamps it at use.
        doc["gpus"]["H100-80GB"]["tables"] = {dt: np.minimum(t, 1.0).tolist() for dt, t in tables.items()}
        doc["gpus"]["H100-80GB"]["attention"] = attention
        TABLE.write_text(compact_json(doc))
    if ns.out:
        Path(ns.out).mkdir(parents=True, exist_ok=True)
        (Path(ns.out) / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
