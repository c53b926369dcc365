"""GEMM efficiency by shape: the GEMMs one TP rank of a Megatron layer runs, timed on this GPU.

    python -m benchmarks.calibration.gemm_efficiency --out gemm_efficiency.json [--budget-s 180] [--quick]

Why: the planner prices a GEMM at the device's large-GEMM rate times an efficiency
that depends on the shape (cost.compute.gemm_efficiency); that curve should be fitted
to a measured table per GPU, not assumed. This measures the table.

Shapes: for hidden sizes 1024-25600, the presets of data/models.json plus published
GPT-3-style (Megatron-LM, ffn 4h) and Llama-style (SwiGLU, 8 query groups) models
of the other sizes; TP 1, 2, 4, 8 where heads, groups and ffn divide; b*s tokens
2048-16384. Per layer: QKV, attention projection, fc1 (2f/t wide with SwiGLU), fc2,
and the output layer (padded vocab/t), each as forward (Y = X W^T), data gradient
(dX = dY W) and weight gradient (dW = dY^T X).

Method: bf16 with torch.matmul in Megatron's operand layouts (forward NT, dgrad NN,
wgrad TN: the transposes Megatron's linear layers pass); fp8 with torch._scaled_mm
(e4m3 operands, per-tensor scales from amax, bf16 output; the second operand
column-major, as Transformer Engine's cached transposes give it; fast accumulation
in forward only, as TE's default recipe). Inputs are random normal. Each distinct
(m, n, k, layout, dtype) is timed once: one untimed run, whose wall time sets the
repeat count (5 to 30, ~5 ms in all), then the median over the repeats, each between
CUDA events with the L2 cache flushed before it (the weights never sit in L2 in
training). Shapes are measured in order of token count 4096, 8192, 2048, 16384 so a
budget cut drops the least common ones; the JSON is rewritten as rows come in.
Efficiency is against the datasheet dense peak of data/gpus.json; `vs_reference`
against the 8192^3 GEMM of the same dtype measured here (the rate the probe reports).
`--quick` runs tiny shapes on the CPU (perf_counter) to check the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu import Gemm, Timer, device_metadata, gemm_step, nvidia_smi, sig, write_json
from megatron_pipette.spec.workload import Workload, model_presets, workload_from_preset

HIDDEN_SIZES = (1024, 2048, 2560, 4096, 5120, 6144, 8192, 12288, 16384, 20480, 25600)
TP_SIZES = (1, 2, 4, 8)
TOKENS = (4096, 8192, 2048, 16384)
"""b*s per micro-batch, in the order measured (a budget cut drops the last)."""
LLAMA3_VOCAB = 128256
# Published models of the sizes the presets lack: name, hidden, heads, query groups, ffn, SwiGLU, vocab.
# GPT-3-style ones are Megatron-LM's scaling series (Narayanan et al. 2021, Table 1; ffn 4h).
EXTRA_MODELS = (
    ("megatron-18.4b", 6144, 48, 48, 4 * 6144, False, 50257),
    ("megatron-39.1b", 8192, 64, 64, 4 * 8192, False, 50257),
    ("megatron-310b", 16384, 128, 128, 4 * 16384, False, 50257),
    ("megatron-530b", 20480, 128, 128, 4 * 20480, False, 50257),
    ("megatron-1t", 25600, 160, 160, 4 * 25600, False, 50257),
    ("llama3.2-1b", 2048, 32, 8, 8192, True, LLAMA3_VOCAB),
    ("llama2-13b", 5120, 40, 40, 13824, True, 32000),
    ("llama3-405b", 16384, 128, 8, 53248, True, LLAMA3_VOCAB),
)
QUICK = dict(hidden=(64, 128), tp=(1, 2), tokens=(64, 32), vocab=1024)


def layer_models(hidden_sizes: tuple[int, ...]) -> list[Workload]:
    """Presets and published models of these hidden sizes, plus a Llama-3-rule SwiGLU model
    (128-wide heads, 8 query groups, ffn 1.3 * 8h/3 rounded up to 1024) for a size without one."""
    def make(name: str, h: int, a: int, g: int, f: int, swiglu: bool, vocab: int) -> Workload:
        return Workload(name=name, num_layers=1, hidden_size=h, num_attention_heads=a, seq_length=2048,
                        global_batch_size=1, group_query_attention=g != a, num_query_groups=g if g != a else None,
                        ffn_hidden_size=f, swiglu=swiglu, vocab_size=vocab)

    models = [workload_from_preset(n) for n, p in model_presets().items() if p["hidden_size"] in hidden_sizes]
    models += [make(*m) for m in EXTRA_MODELS if m[1] in hidden_sizes]
    for h in hidden_sizes:
        if not any(m.hidden_size == h and m.swiglu for m in models):
            a = max(h // 128, 1)
            f = math.ceil(1.3 * 8 * h / 3 / 1024) * 1024
            models.append(make(f"swiglu-{h}", h, a, 8 if a % 8 == 0 else a, f, True, LLAMA3_VOCAB))
    return models


def linear_gemms(tokens: int, out: int, inp: int, dtype: str) -> dict[str, Gemm]:
    """Forward, data-gradient and weight-gradient GEMMs of a linear layer [inp -> out]."""
    if dtype == "fp8":  # TE: every GEMM on fp8 copies laid out as cuBLAS wants (A row-, B column-major)
        return {"fwd": Gemm(tokens, out, inp, "NT", dtype, True), "dgrad": Gemm(tokens, inp, out, "NT", dtype),
                "wgrad": Gemm(out, inp, tokens, "NT", dtype)}
    return {"fwd": Gemm(tokens, out, inp, "NT", dtype), "dgrad": Gemm(tokens, inp, out, "NN", dtype),
            "wgrad": Gemm(out, inp, tokens, "TN", dtype)}


def layer_linears(w: Workload, tp: int) -> dict[str, tuple[int, int]] | None:
    """(out, in) of each linear on one TP rank; None when TP does not divide the model."""
    a, g, d, f, h = w.num_attention_heads, w.query_groups, w.head_dim, w.ffn, w.hidden_size
    if a % tp or g % tp or f % tp:
        return None
    return {"qkv": ((a + 2 * g) * d // tp, h), "proj": (h, a * d // tp),
            "fc1": ((2 if w.swiglu else 1) * f // tp, h), "fc2": (h, f // tp),
            "output": (w.padded_vocab_size(tp) // tp, h)}


def plan(models: list[Workload], tps: tuple[int, ...], tokens: tuple[int, ...],
         dtypes: tuple[str, ...]) -> dict[Gemm, list[str]]:
    """Distinct GEMMs in measuring order, each with the uses ("model/linear/pass/tTP/TOKENS") it stands for."""
    shapes: dict[Gemm, list[str]] = {}
    for n in tokens:
        for w in sorted(models, key=lambda m: m.hidden_size):
            for tp in tps:
                for name, (out, inp) in (layer_linears(w, tp) or {}).items():
                    for dtype in dtypes:
                        for pass_, gemm in linear_gemms(n, out, inp, dtype).items():
                            shapes.setdefault(gemm, []).append(f"{w.name}/{name}/{pass_}/t{tp}/{n}")
    return shapes


def efficiency(tflops: float, dtype: str, meta: dict) -> float | None:
    peak = meta["peak_flops"].get(dtype)
    return sig(tflops * 1e12 / peak) if peak else None


def time_gemms(shapes: dict[Gemm, list[str]], device: torch.device, deadline: float) -> Iterator[dict]:
    """One row per GEMM until the deadline (time.monotonic()); errors (fp8 unsupported, out of memory)
    become rows with an "error" instead of stopping the table."""
    timer = Timer(device)
    for g, uses in shapes.items():
        if time.monotonic() > deadline:
            return
        row = {"m": g.m, "n": g.n, "k": g.k, "dtype": g.dtype, "layout": g.layout}
        if g.dtype == "fp8":
            row["fast_accum"] = g.fast_accum
        try:
            (t,) = timer.measure(gemm_step(g, device))
            row.update(time_s=t, tflops=sig(g.flops / t / 1e12))
        except (RuntimeError, torch.OutOfMemoryError) as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
        yield {**row, "uses": uses}


def fit_half_dim(rows: list[dict], reference: dict[str, float]) -> dict[str, dict]:
    """Per dtype, the GEMM_HALF_DIM c of the planner's curve prod(x / (x + c)) that best fits
    tflops / reference (least squares in log), and the median and worst error it leaves."""
    fits = {}
    for dtype, ref in reference.items():
        data = np.array([(r["m"], r["n"], r["k"], r["tflops"] / ref) for r in rows
                         if r["dtype"] == dtype and "tflops" in r], dtype=float).reshape(-1, 4)
        if not len(data):
            continue
        dims, measured = data[:, :3], np.log(data[:, 3])
        grid = np.arange(0, 1025, 4, dtype=float)
        # errors[c, gemm]: log measured - log modelled efficiency
        errors = measured[None, :] - np.log(dims[None] / (dims[None] + grid[:, None, None])).sum(axis=2)
        best = int(np.argmin((errors ** 2).sum(axis=1)))
        rel = np.abs(np.expm1(errors[best]))
        fits[dtype] = {"half_dim": int(grid[best]), "median_rel_error": round(float(np.median(rel)), 3),
                       "max_rel_error": round(float(rel.max()), 3), "points": len(data)}
    return fits


def summary(doc: dict) -> str:
    """Efficiency quantiles per dtype and smallest dimension, the reference rates and the fit."""
    lines = [f"device {doc['meta']['device_name']}; peaks (TFLOP/s): "
             + ", ".join(f"{k} {v / 1e12:g}" for k, v in doc["meta"]["peak_flops"].items())]
    for dtype, r in doc["reference"].items():
        lines.append(f"reference {r['n']}^3 {dtype}: {r['tflops']:.0f} TFLOP/s (efficiency {r['efficiency']})")
    rows = [r for r in doc["rows"] if "tflops" in r]
    lines.append(f"{len(rows)} GEMMs timed, {len(doc['rows']) - len(rows)} failed, "
                 f"{doc['planned'] - len(doc['rows'])} left out by the budget")
    lines.append(f"{'dtype':>5} {'min dim':>10} {'count':>5} {'TFLOP/s p10':>11} {'p50':>6} {'p90':>6}"
                 f" {'eff p50':>7} {'vs ref p50':>10}")
    for dtype in doc["reference"]:
        for lo, hi in ((0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 10**9)):
            sel = sorted((r for r in rows if r["dtype"] == dtype and lo <= min(r["m"], r["n"], r["k"]) < hi),
                         key=lambda r: r["tflops"])
            if not sel:
                continue
            q = [sel[int(p * (len(sel) - 1))] for p in (0.1, 0.5, 0.9)]
            eff, vs_ref = (str(q[1].get(k) or "-") for k in ("efficiency", "vs_reference"))
            lines.append(f"{dtype:>5} {f'{lo}-{hi}' if hi < 10**9 else f'>={lo}':>10} {len(sel):>5} "
                         f"{q[0]['tflops']:>11.1f} {q[1]['tflops']:>6.1f} {q[2]['tflops']:>6.1f} "
                         f"{eff:>7} {vs_ref:>10}")
    for dtype, f in doc["fit"].items():
        lines.append(f"fit {dtype}: GEMM_HALF_DIM {f['half_dim']} (planner: 32), median error "
                     f"{f['median_rel_error']:.1%}, worst {f['max_rel_error']:.1%} over {f['points']} GEMMs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file, rewritten as rows come in")
    p.add_argument("--budget-s", type=float, default=180.0, help="stop starting new GEMMs after this long")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS),
                   help="b*s per micro-batch, in measuring order (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: checks the script only")
    ns = p.parse_args(argv)
    start = time.monotonic()
    device = torch.device("cpu" if ns.quick else "cuda")
    hidden, tps, tokens = (QUICK["hidden"], QUICK["tp"], QUICK["tokens"]) if ns.quick else (
        HIDDEN_SIZES, TP_SIZES, tuple(ns.tokens))
    models = layer_models(hidden)
    if ns.quick:
        models = [dataclasses.replace(w, vocab_size=QUICK["vocab"]) for w in models]
    shapes = plan(models, tps, tokens, tuple(ns.dtypes))
    flops = sum(g.flops for g in shapes)
    print(f"{len(models)} models, {len(shapes)} distinct GEMMs, {flops / 1e15:.1f} PFLOP per pass over them",
          flush=True)
    meta = device_metadata(device)
    meta["method"] = __doc__.split("Method: ", 1)[1].split("\n\n")[0].replace("\n", " ")
    meta["models"] = {w.name: {"hidden_size": w.hidden_size, "heads": w.num_attention_heads,
                               "query_groups": w.query_groups, "head_dim": w.head_dim, "ffn": w.ffn,
                               "swiglu": w.swiglu, "vocab_size": w.vocab_size} for w in models}
    out = Path(ns.out)
    ref_n = 128 if ns.quick else 8192
    reference = {}
    for row in time_gemms({Gemm(ref_n, ref_n, ref_n, "NN" if d == "bf16" else "NT", d): [] for d in ns.dtypes},
                          device, math.inf):
        if "tflops" in row:
            reference[row["dtype"]] = {"n": ref_n, "tflops": row["tflops"],
                                       "efficiency": efficiency(row["tflops"], row["dtype"], meta)}
        else:
            print(f"reference {row['dtype']}: {row['error']}", flush=True)
    doc = {"meta": meta, "reference": reference, "planned": len(shapes), "rows": [], "fit": {}}
    deadline = start + ns.budget_s
    last_write = time.monotonic()
    for i, row in enumerate(time_gemms(shapes, device, deadline), 1):
        if "tflops" in row:
            row["efficiency"] = efficiency(row["tflops"], row["dtype"], meta)
            ref = reference.get(row["dtype"])
            row["vs_reference"] = sig(row["tflops"] / ref["tflops"]) if ref else None
        doc["rows"].append(row)
        if time.monotonic() - last_write > 10:
            write_json(out, doc)
            last_write = time.monotonic()
            print(f"  {i}/{len(shapes)} GEMMs, {time.monotonic() - start:.0f} s", flush=True)
    meta["elapsed_s"] = round(time.monotonic() - start, 1)
    meta["nvidia_smi_after"] = nvidia_smi() if device.type == "cuda" else None
    doc["fit"] = fit_half_dim(doc["rows"], {d: r["tflops"] for d, r in reference.items()})
    write_json(out, doc)
    print(summary(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
