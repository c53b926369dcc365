"""The planner's causal-attention price held against an attention.json the GPU machine wrote.

    python -m benchmarks.validation.attention_prices benchmarks/results/h200-2026-11-26-profiles/attention.json

Why: attention_efficiency.py's own `forward_ratio` compares with the planner's price without its
measured kernel curves; this prices each row as the planner does (cost.gemm.attention_curve of the
row's GPU, at the large-GEMM rate) and prints measured/price, median [min, max], by kernel and s.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from megatron_pipette.cost.gemm import attention_curve
from megatron_pipette.spec.hardware import lookup_gpu

BACKENDS = {"cudnn": "auto", "flash": "flash"}
"""attention_efficiency.py's kernels as the --attention-backend whose curve prices them."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("attention_json", type=Path)
    ns = p.parse_args(argv)
    doc = json.loads(ns.attention_json.read_text())
    gpu = lookup_gpu(doc["meta"]["device_name"])
    rate = gpu.large_gemm_rate("bf16")
    ratios: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in doc["rows"]:
        curve = attention_curve(gpu, BACKENDS[r["backend"]])
        flops = r["forward_tflops_causal"] * 1e12 * r["forward_s"]
        forward_s = flops / (rate * curve.efficiency(0, flops))
        backward_s = 2 * flops / (rate * curve.efficiency(1, 2 * flops))
        ratios.setdefault((r["backend"], r["s"]), []).append((r["forward_s"] / forward_s, r["backward_s"] / backward_s))
    print(f"{gpu.name}: measured / the planner's price, median [min, max]")
    for (kernel, s), rs in sorted(ratios.items()):
        cells = []
        for i, name in enumerate(("forward", "backward")):
            xs = [x[i] for x in rs]
            cells.append(f"{name} {statistics.median(xs):.3g} [{min(xs):.3g}, {max(xs):.3g}]")
        print(f"  {kernel:>5} s {s:>6}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
