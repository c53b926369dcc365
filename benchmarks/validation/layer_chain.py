"""What an isolated layer's timing carries that a stack of layers pays once: one layer of the ~1.3B GPT
(cost_check.py's train part: hidden 2048, 16 heads, seq 2048, bf16, local spec) timed as the
profiler times it (one forward, one backward, CUDA events), then as a chain of 2 and 4 calls of
the same block in one autograd graph, per micro-batch size.

    python -m benchmarks.validation.layer_chain --out DIR [--dry-run] [--mbs 1 2 4 8] [--iters N]

Why: on the H200 (2026-11-28, h200-2026-11-28-pick) the in-job prediction of micro-batch 2 came out
x1.16 of the measured step while micro-batches 4 and 8 were x0.95 and x0.93. If each isolated call
carries a fixed cost (autograd's start of a backward, the first kernel's launch after a
synchronisation) that a stack pays once per micro-batch, then per call T(k) = k * marginal +
intercept, and the profile's T(1) over-prices small micro-batches by the intercept on every layer.
This prints, per micro-batch size, T(1), the marginal (T(4) - T(2)) / 2, and the intercept
T(2) - 2 (T(4) - T(2)) / 2 ... as forward, backward and their sum. `--dry-run` runs a tiny layer on
the CPU to check the script: its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def chain_times(workload, mbs: int, calls: int, env, warmup: int, iters: int) -> tuple[float, float]:
    """Median (forward, backward) seconds of `calls` chained calls of one layer at `mbs`."""
    import dataclasses

    import torch

    from megatron_pipette.profile.build import layer_step
    from megatron_pipette.profile.measure import time_step

    one = layer_step(workload, 1, mbs, None, env, te=False)

    def forward() -> torch.Tensor:
        out = one.forward()
        for _ in range(calls - 1):
            out = one.again(out)
        return out

    t = time_step(dataclasses.replace(one, forward=forward, again=None), env.device, warmup, iters)  # as a whole
    return t.forward_s, t.backward_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--mbs", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--iters", type=int, default=10)
    ns = p.parse_args(argv)
    import torch

    from megatron_pipette.profile.runtime import resolve_device, single_device_megatron
    from megatron_pipette.spec.workload import Workload

    device = resolve_device("cpu" if ns.dry_run else None)
    size = dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=64) if ns.dry_run else \
        dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048)
    workload = Workload(**size, global_batch_size=8, vocab_size=32000, position_embedding_type="learned_absolute",
                        precision="fp32" if ns.dry_run else "bf16")
    rows = []
    with single_device_megatron(device) as env:
        for mbs in ns.mbs:
            t = {k: chain_times(workload, mbs, k, env, warmup=3, iters=ns.iters) for k in (1, 2, 4)}
            total = {k: sum(v) for k, v in t.items()}
            marginal = (total[4] - total[2]) / 2
            row = {"mbs": mbs, "t1_s": total[1], "t2_s": total[2], "t4_s": total[4], "marginal_s": marginal,
                   "intercept_s": total[2] - 2 * marginal, "forward_s": {k: v[0] for k, v in t.items()},
                   "backward_s": {k: v[1] for k, v in t.items()}}
            rows.append(row)
            print(f"mbs {mbs}: T1 {total[1] * 1e3:8.3f} ms  T2/2 {total[2] / 2 * 1e3:8.3f}  "
                  f"T4/4 {total[4] / 4 * 1e3:8.3f}  marginal {marginal * 1e3:8.3f}  "
                  f"intercept {row['intercept_s'] * 1e3:7.3f}  "
                  f"T1/marginal {total[1] / marginal:6.3f}", flush=True)
    ns.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "workload": size, "precision": workload.precision, "iters": ns.iters,
            "median_of": "forward and backward each, CUDA events per iteration (profile.measure.time_step)"}
    (ns.out / "layer_chain.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("median T1/marginal:", round(statistics.median(r["t1_s"] / r["marginal_s"] for r in rows), 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
