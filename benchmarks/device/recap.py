"""Short recap of a GPU-machine run's result folder, printed last so it survives a cut log.

    python -m benchmarks.device.recap OUT_DIR

Why: only the end of the run's output comes back with the files; this puts the figures
that matter in a few lines there: the GEMM table's summary and fit, attention's
measured/modelled time ratios, each layer profile's measured/modelled ratios, and the cost
check's measured/predicted figures (cost_check.py), and each in-job start's lines (in_job.py).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from benchmarks.calibration.gemm_efficiency import summary
from benchmarks.validation.cost_check import recap as cost_check_lines
from benchmarks.validation.in_job import summary as in_job_lines


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def attention_lines(doc: dict) -> list[str]:
    """Median measured/modelled time per backend and sequence length, and the causal rate."""
    lines = [f"attention ({len(doc['rows'])} of {doc['planned']} measured): median over heads of "
             "measured/model time and causal TFLOP/s"]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in doc["rows"]:
        if "forward_s" in r:
            groups.setdefault((r["backend"], r["s"]), []).append(r)
    for (backend, s), rows in sorted(groups.items()):
        def med(key: str, rows: list = rows) -> float:
            return statistics.median(r[key] for r in rows)

        lines.append(f"  {backend:>7} s {s:>6}: fwd/model {med('forward_ratio'):.3g} bwd/model "
                     f"{med('backward_ratio'):.3g}; causal TFLOP/s fwd {med('forward_tflops_causal'):.0f} "
                     f"bwd {med('backward_tflops_causal'):.0f}")
    failed = sum("forward_s" not in r for r in doc["rows"])
    if failed:
        lines.append(f"  {failed} failed, e.g. {next(r for r in doc['rows'] if 'forward_s' not in r)['errors'][-1]}")
    return lines


def profile_lines(name: str, profile: dict | None, rows: list[dict] | None) -> list[str]:
    """Per TP size, the measured micro-batches without recompute or SP: time and activation ratios."""
    if profile is None:
        return [f"profile {name}: no result"]
    m = profile["measurement"]
    lines = [f"profile {name}: {len(m['measured'])} shapes measured, {len(m['skipped'])} skipped, "
             f"{m['elapsed_s']} s, spec {m['layer_spec']}, softmax fusion {m.get('masked_softmax_fusion')}"]
    for r in rows or []:
        if r["measured"] and not r["sp"] and r["recompute"] is None:
            timed = (f"fwd {r['forward_s'] * 1e3:.2f} ms x{r['forward_ratio']:.2f}, "
                     f"bwd {r['backward_s'] * 1e3:.2f} ms x{r['backward_ratio']:.2f}, " if "forward_ratio" in r else "")
            lines.append(f"  tp {r['tp']} mbs {r['mbs']}: {timed}activations x{r['activation_ratio']:.3f} "
                         "(measured/model)")
    return lines


def main(out: Path) -> int:
    gemm = load(out / "gemm_efficiency.json")
    if gemm:
        print(summary(gemm))
    attention = load(out / "attention.json")
    if attention:
        print("\n".join(attention_lines(attention)))
    compare = load(out / "compare.json") or {}
    for path in sorted(out.glob("profile_*.json")):
        name = path.stem.removeprefix("profile_")
        print("\n".join(profile_lines(name, load(path), compare.get(name))))
    for line in cost_check_lines(out):
        print(line)
    for row in (load(out / "in_job" / "in_job.json") or {}).get("starts", []):
        print("\n".join(in_job_lines(row)))
    for path in sorted(out.iterdir()):
        print(f"{path.name:>28} {path.stat().st_size / 2**20:8.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
