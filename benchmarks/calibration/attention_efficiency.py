"""Causal attention on this GPU: torch's fused kernels against the planner's core-attention price.

    python -m benchmarks.calibration.attention_efficiency --out attention.json [--budget-s 45] [--quick]

Why: the planner prices the core attention (scores and weighted values) of a causal flash or
fused kernel at half the full s x s work (2 b s^2 a d FLOPs forward, twice that backward) at
the rate measured here (the attention tables of data/gemm_efficiency.json, fitted from this
script's output by benchmarks/calibration/gemm_table.py), or without a table at its GEMM curve. This times
torch.nn.functional.scaled_dot_product_attention (causal, bf16) forward and backward with
the flash backend (FlashAttention-2) and the cuDNN backend (the kernel Transformer
Engine's fused attention runs) at one TP rank's shapes (b 1, heads/TP, query groups/TP,
head dim) of gpt3-1.3b, llama3-8b, gpt3-13b and llama3-70b at s 2048-32768, and reports
TFLOP/s counted causal (half the full count) and full, and measured / modelled time,
the model being the planner's without a table: the causal count over the 8192^3 bf16 GEMM rate
measured here times the planner's efficiency (cost.compute.gemm_curve) of the score and value
GEMMs. Backward FLOPs
are counted as the planner counts them, twice the forward (the kernels also recompute
the scores: 2.5 times the forward's matrix work).

Method: q, k, v random normal in Megatron's [b, s, heads, d] layout, passed transposed
([b, heads, s, d] views); GQA through enable_gqa, or with k and v repeated to all heads
where the backend refuses it ("gqa" says which). Backward is autograd.grad of the
output against a random gradient. Timing as benchmarks/calibration/gemm_efficiency.py (CUDA events,
L2 flushed, median of >= 5 after warm-up). `--quick` runs tiny shapes on the CPU with
torch's default backend.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gpu import Gemm, Timer, device_metadata, gemm_step, sig, write_json
from megatron_pipette.cost.compute import RankShape, core_attention
from megatron_pipette.cost.gemm import GemmCurve, gemm_curve
from megatron_pipette.spec.hardware import gpu_catalog
from megatron_pipette.spec.workload import workload_from_preset

MODELS = ("gpt3-1.3b", "llama3-8b", "gpt3-13b", "llama3-70b")
SEQ_LENGTHS = (2048, 4096, 8192, 32768)
TP_SIZES = (1, 2, 4, 8)
BACKENDS = ("flash", "cudnn")
QUICK_SHAPES = ((2, 2, 64, 16), (4, 2, 128, 16))
"""(heads, query groups, s, head dim) for --quick, run on torch's default CPU backend."""


def shapes(quick: bool) -> list[tuple[int, int, int, int, str]]:
    """(heads, query groups, s, head dim, uses) per rank, distinct, shortest sequences first."""
    if quick:
        return [(*s, "quick") for s in QUICK_SHAPES]
    found: dict[tuple[int, int, int, int], list[str]] = {}
    for s in SEQ_LENGTHS:
        for name in MODELS:
            w = workload_from_preset(name)
            for tp in TP_SIZES:
                if w.num_attention_heads % tp == 0 and w.query_groups % tp == 0:
                    key = (w.num_attention_heads // tp, w.query_groups // tp, s, w.head_dim)
                    found.setdefault(key, []).append(f"{name}/t{tp}")
    return [(*k, ",".join(v)) for k, v in found.items()]


def backend_context(backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "default":
        return contextlib.nullcontext()
    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend])


def attention_step(heads: int, groups: int, s: int, d: int, backend: str, gqa: bool, device: torch.device):
    """Random q, k, v, output gradient, and the step marking forward and backward."""
    kv_heads = groups if gqa else heads

    def rand(h: int) -> torch.Tensor:
        return torch.randn(1, s, h, d, device=device, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    grad = torch.randn(1, heads, s, d, device=device, dtype=torch.bfloat16)
    extra = {"enable_gqa": True} if gqa and groups != heads else {}

    def step(mark) -> None:
        with backend_context(backend):
            mark()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
            mark()
            torch.autograd.grad(out, (q, k, v), grad)
            mark()

    return step


def model_seconds(heads: int, s: int, d: int, rate: float, curve: GemmCurve) -> tuple[float, float]:
    """The planner's forward and backward core-attention seconds for b = 1 at `rate` FLOP/s: the
    causal half at the GEMM curve's efficiency, as priced where no attention table was measured
    (the table fitted from this run, where one was, reproduces it by construction)."""
    shape = RankShape(tokens=s, micro_batch=1, seq_length=s, cp=1, hidden=heads * d, heads=heads, query_groups=heads,
                      query_head_dim=d, value_head_dim=d, ffn=4 * heads * d, element_bytes=2, sp=1)
    forward, backward = core_attention(shape=shape, gemm=curve, attention=None, causal_kernel=True)
    return forward / rate, backward / rate


def measure(timer: Timer, shape: tuple, backend: str, device: torch.device) -> dict:
    """Time one shape on one backend, native GQA first; the row says what ran, or why nothing did."""
    heads, groups, s, d, uses = shape
    row = {"backend": backend, "b": 1, "heads": heads, "query_groups": groups, "s": s, "head_dim": d,
           "uses": uses}
    errors = []
    for gqa in ((True, False) if groups != heads else (False,)):
        try:
            fwd, bwd = timer.measure(attention_step(heads, groups, s, d, backend, gqa, device), phases=2)
        except (RuntimeError, torch.OutOfMemoryError) as e:
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        full = 4.0 * s * s * heads * d  # forward, b = 1
        row.update(gqa="native" if gqa else ("expanded" if groups != heads else "none"),
                   forward_s=fwd, backward_s=bwd,
                   forward_tflops_causal=sig(full / 2 / fwd / 1e12), forward_tflops_full=sig(full / fwd / 1e12),
                   backward_tflops_causal=sig(full / bwd / 1e12), backward_tflops_full=sig(2 * full / bwd / 1e12))
        break
    if errors:
        row["errors"] = errors
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=45.0, help="stop starting new shapes after this long")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: checks the script only")
    ns = p.parse_args(argv)
    start = time.monotonic()
    device = torch.device("cpu" if ns.quick else "cuda")
    timer = Timer(device)
    ref_n = 128 if ns.quick else 8192
    ref = Gemm(ref_n, ref_n, ref_n, "NN", "bf16")
    (ref_s,) = timer.measure(gemm_step(ref, device))
    rate = ref.flops / ref_s
    curve = gemm_curve(gpu_catalog().get(device_metadata(device)["device_name"].lower()), "bf16")
    meta = {**device_metadata(device), "reference_bf16_flops": rate, "reference_gemm": f"{ref_n}^3 bf16",
            "method": __doc__.split("Method: ", 1)[1].replace("\n", " ").strip()}
    todo = [(shape, b) for shape in shapes(ns.quick) for b in (("default",) if ns.quick else BACKENDS)]
    doc = {"meta": meta, "planned": len(todo), "rows": []}
    out = Path(ns.out)
    print(f"{len(todo)} attention shapes x backends; reference {rate / 1e12:.0f} TFLOP/s", flush=True)
    for shape, backend in todo:
        if time.monotonic() - start > ns.budget_s:
            break
        row = measure(timer, shape, backend, device)
        if "forward_s" in row:
            mf, mb = model_seconds(row["heads"], row["s"], row["head_dim"], rate, curve)
            row.update(model_forward_s=mf, model_backward_s=mb, forward_ratio=sig(row["forward_s"] / mf),
                       backward_ratio=sig(row["backward_s"] / mb))
        doc["rows"].append(row)
        write_json(out, doc)
    meta["elapsed_s"] = round(time.monotonic() - start, 1)
    write_json(out, doc)
    print(f"{'backend':>7} {'heads':>5} {'groups':>6} {'s':>6} {'gqa':>8} {'fwd ms':>8} {'causal TF':>9} "
          f"{'full TF':>7} {'bwd ms':>8} {'causal TF':>9} {'full TF':>7} {'fwd/model':>9} {'bwd/model':>9}")
    for r in doc["rows"]:
        if "forward_s" not in r:
            print(f"{r['backend']:>7} {r['heads']:>5} {r['query_groups']:>6} {r['s']:>6} failed: {r['errors'][-1]}")
            continue
        print(f"{r['backend']:>7} {r['heads']:>5} {r['query_groups']:>6} {r['s']:>6} {r['gqa']:>8} "
              f"{r['forward_s'] * 1e3:>8.3f} {r['forward_tflops_causal']:>9.4g} {r['forward_tflops_full']:>7.4g} "
              f"{r['backward_s'] * 1e3:>8.3f} {r['backward_tflops_causal']:>9.4g} {r['backward_tflops_full']:>7.4g} "
              f"{r['forward_ratio']:>9.3g} {r['backward_ratio']:>9.3g}")
    left = doc["planned"] - len(doc["rows"])
    cut = f", {left} left out by the budget" if left else ""
    print(f"{len(doc['rows'])} measured in {meta['elapsed_s']} s{cut}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
