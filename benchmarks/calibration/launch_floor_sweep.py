"""Price both development sets' recipe rows at several host costs per Transformer Engine kernel; print
each set's summary and every row's error.

    python -m benchmarks.calibration.launch_floor_sweep [--us 0 4 8 16 33] [--sets h100 blackwell]

Why: cost.launch.TE_SECONDS_PER_KERNEL is not measured (the lent H200 has no Transformer Engine); the
published runs bound it. A cost at which a row moves away from its measurement is too high for the
hosts NVIDIA ran on; the value kept is below the lowest such cost (docs/time-model.md, "Launch floor
and CUDA graphs"). The backward's cost keeps the local spec's measured ratio to the forward's. No
search: the published layouts only.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_pipette.cost import launch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--us", type=float, nargs="+", default=[0.0, 4.0, 8.0, 16.0, 33.0],
                   help="forward host microseconds per Transformer Engine kernel")
    p.add_argument("--sets", nargs="+", choices=("h100", "blackwell"), default=["h100", "blackwell"])
    ns = p.parse_args(argv)
    from benchmarks.validation import published_runs_blackwell, published_runs_h100

    kept = launch.TE_SECONDS_PER_KERNEL
    ratio = launch.LOCAL_SECONDS_PER_KERNEL[1] / launch.LOCAL_SECONDS_PER_KERNEL[0]
    pricing = {"h100": (published_runs_h100.DATA, lambda row: published_runs_h100.result_row(row, search=False)),
               "blackwell": (published_runs_blackwell.DATA,
                             lambda row: published_runs_blackwell.priced_row(row, False))}
    try:
        for us in ns.us:
            launch.TE_SECONDS_PER_KERNEL = (us * 1e-6, us * 1e-6 * ratio)
            for name in ns.sets:
                data, price = pricing[name]
                rows = json.loads(data.read_text())["rows"]
                out = [price(row) for row in rows]
                s = published_runs_h100.summary(out, "recipe")
                print(f"{name} {us:g} us: {s['priced']}/{s['runs']} priced, mean |error| {s['mean_abs_error']:.1%}, "
                      f"signed {s['mean_error']:+.1%}, worst {s['worst_error']:+.1%}, {s['beyond_25pct']} beyond 25%",
                      flush=True)
                print("  " + json.dumps({row["id"]: round(100 * o["recipe"]["error"], 1)
                                         for row, o in zip(rows, out, strict=True) if "error" in o["recipe"]}),
                      flush=True)
    finally:
        launch.TE_SECONDS_PER_KERNEL = kept
    return 0


if __name__ == "__main__":
    sys.exit(main())
