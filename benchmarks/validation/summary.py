"""The README's validation table, generated from the kept results, so every figure in it is traceable.

    python -m benchmarks.validation.summary            # prints the table
    python -m benchmarks.validation.summary --check    # exits 1 when README.md's table differs

Why: figures typed into a README drift from the runs they came from. Each row here reads one kept
result file (the newest of its benchmark) and names it with the command that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- validation table: benchmarks/validation/summary.py -->", "<!-- end of validation table -->"


def _load(folder: str) -> dict:
    return _load_part(folder, "results")


def _load_part(folder: str, name: str) -> dict:
    return json.loads((RESULTS / folder / f"{name}.json").read_text())


SELF_CHECK = re.compile(r"self-check, iterations \S+: predicted ([0-9.]+) s/iteration, measured ([0-9.]+) s")
HOOK_TOTAL = re.compile(r"^phases: .*total ([0-9.]+) s")


def _in_job(folder: str) -> dict[str, dict]:
    """Each start of an in-job run by name: its median step, first iteration, and the hook's
    self-check (measured/predicted) and wall time as its lines print them."""
    starts = {}
    for row in _load_part(f"{folder}/in_job", "in_job")["starts"]:
        check = next(m for m in map(SELF_CHECK.search, row["hook"]) if m)
        total = next(m for m in map(HOOK_TOTAL.match, row["hook"]) if m)
        starts[row["name"]] = {**row, "ratio": float(check[2]) / float(check[1]), "hook_s": float(total[1])}
    return starts


H100_FOLDER = "published_runs_h100-2026-11-29-picks"
A100_FOLDER = "published_runs-2026-11-28-fragmentation"
BLACKWELL_FIT = "fit_blackwell-2026-11-29"
BLACKWELL_FOLDER = "published_runs_blackwell-2026-11-29-stash"
"""The development sets' current kept results (tests/benchmarks/test_kept_results.py prices the sets
again and holds these to the code)."""


def _blackwell_fit() -> str:
    """The Blackwell step GEMM fractions adopted (benchmarks.calibration.fit_blackwell), each with
    its held-out-by-model mean |error|."""
    fits = json.loads((RESULTS / BLACKWELL_FIT / "results.json").read_text())["gpus"]
    return ", ".join(
        f"{cluster.removeprefix('dgx-').removesuffix('-nvl72').upper()} {fit['step_gemm_fraction']:.2f} on its "
        f"{len(fit['rows'])} dense rows, {statistics.mean(abs(e) for e in fit['held_out_by_model'].values()):.1%} mean "
        "\\|error\\| with each model held out" for cluster, fit in sorted(fits.items()) if fit["adopted"])


def rows() -> list[list[str]]:
    h100 = _load(H100_FOLDER)
    s = h100["summary"]["recipe"]
    a100_run = _load(A100_FOLDER)
    a100 = a100_run["summary"]
    bw_run = _load(BLACKWELL_FOLDER)
    bw = bw_run["summary"]["recipe"]
    refused = ", ".join(f"{reason} {n}" for reason, n in sorted(bw_run["refusals"]["by_first_reason"].items(),
                                                                 key=lambda kv: -kv[1])) or "none"
    emulated_folder = "emulated_cluster-2026-11-28-batched-exchanges"
    emulated = _load(emulated_folder)
    held, fresh, placed = emulated["predictions_held_out"], emulated["predictions_fresh"], emulated["placement_4nodes"]

    def best_vs_fastest(run: dict) -> str:
        measured = {r["layout"]: r["measured_s"] for r in run["rows"]}
        return f"{measured[run['predicted_best']] / measured[run['measured_best']] - 1:+.0%}"
    gpu = "h200-2026-11-26"
    sustained = {r["dtype"]: r["ratio"] for r in _load_part(f"{gpu}-cost-check", "sustained")["rows"]}
    loop = statistics.median(r["ratio"]["loop"] for r in _load_part(f"{gpu}-cost-check", "grouped")["rows"])
    step = {r["what"]: r["ratio"] for r in _load_part(f"{gpu}-profiles", "train")["rows"]}
    job, pick = _in_job("h200-2026-11-28-in-job"), _in_job("h200-2026-11-28-chain-pick")
    others = ", ".join(f"{r['step_s']:.3f} s ({n[3:]})" for n, r in pick.items() if n.startswith("mbs"))
    checks = ", ".join(f"x{r['ratio']:.2f} ({n[3:] if n.startswith('mbs') else '8'})" for n, r in pick.items())
    return [
        ["NVIDIA's published H100 runs, the development set (19: NeMo 24.07, Megatron-Bridge 25.09-26.04, "
         "Megatron-LM README), published layouts with their recipes. **A fit**: the three fitted constants were "
         "fitted on these rows, so the error is the fit's residual (and Transformer Engine's launch cost was "
         "chosen under the bound these and the Blackwell rows set)",
         f"mean \\|error\\| {s['mean_abs_error']:.1%}, signed {s['mean_error']:+.1%}, worst {s['worst_error']:+.1%}; "
         f"{s['priced']} of {s['runs']} priced, {s['predicted_not_to_fit']} of them predicted not to fit; "
         f"MoE free-search median gain "
         f"{s['moe_median_search_gain']:+.0%}",
         "`python -m benchmarks.validation.published_runs_h100`",
         f"{h100['date']}, `{H100_FOLDER}`"],
        ["Published A100 runs (18: Narayanan et al. 2021, Korthikanti et al. 2022, transcribed from memory). "
         "**Half held out**: the A100's GEMM efficiency was calibrated on the other half",
         f"held-out half ({a100['held-out']['runs']}) mean \\|error\\| {a100['held-out']['mean_abs_error']:.1%}, "
         f"worst {a100['held-out']['worst_error']:+.1%}; the calibration's half "
         f"{a100['dev']['mean_abs_error']:.1%}, all {a100['all']['mean_abs_error']:.1%}",
         "`python -m benchmarks.validation.published_runs`",
         f"{a100_run['date']}, `{A100_FOLDER}`"],
        ["NVIDIA's published Blackwell runs (126: Megatron-Bridge 25.09-26.08 on DGX-B200, DGX-B300, GB200 and "
         "GB300 NVL72), published layouts with what the perf recipes set. **A fit** for one GPU: the step GEMM "
         f"fraction of {_blackwell_fit()}; the other Blackwell efficiencies are assumed",
         f"{bw['priced']} of {bw['runs']} priced: mean \\|error\\| {bw['mean_abs_error']:.1%}, signed "
         f"{bw['mean_error']:+.1%}, worst {bw['worst_error']:+.1%}, {bw['beyond_25pct']} beyond 25% (of them "
         f"{bw['beyond_25pct_release_step']} at inputs the releases measured more than 25% apart, "
         f"{bw['beyond_25pct_release_step_elsewhere']} of a run another system's releases measured so, "
         f"{bw['beyond_25pct_another_recipe']} run from another recipe than the one read, "
         f"{bw['beyond_25pct_unexplained']} unexplained), {bw['predicted_not_to_fit']} predicted not to fit (of them "
         f"{bw['not_fit_another_recipe']} run from another recipe, {bw['not_fit_unexplained']} unexplained); "
         f"refused by name: {refused}",
         "`python -m benchmarks.validation.published_runs_blackwell`",
         f"{bw_run['date']}, `{BLACKWELL_FOLDER}`"],
        ["Emulated 4-node cluster (network namespaces, shaped links, CPU training), each layout checked to "
         "train as pinned: 22 **held out** but looked at for the diagnosis behind the last change, and 12 "
         "**fresh** ones drawn after it",
         f"held out: MAPE {held['mape']:.1%}, Kendall tau {held['kendall_tau']:.2f}, the predicted-best layout "
         f"{best_vs_fastest(held)} against the fastest measured; fresh: MAPE {fresh['mape']:.1%}, tau "
         f"{fresh['kendall_tau']:.2f}, predicted-best {best_vs_fastest(fresh)}; placement {placed['ratio']:.2f}x "
         "faster than Megatron's order",
         "`python -m benchmarks.validation.emulated_cluster --only held-out`, `--only fresh` (root)",
         f"2026-11-28, `{emulated_folder}`"],
        ["One H200, no Transformer Engine: kernels held against their prices, and a 1.28B GPT's training step "
         "(Megatron's local layers). **Held out**: nothing was fitted on this GPU",
         f"GEMM held 60 s: rate x{sustained['bf16']:.3f} of its price in bf16, x{sustained['fp8']:.3f} in fp8; "
         f"MoE expert GEMMs (a per-expert loop) median time x{loop:.2f}; the step's peak memory "
         f"x{step['max_allocated_bytes']:.3f}, its time x{step['step_s']:.2f}",
         "`bash benchmarks/device/cost_check.sh` on the GPU (benchmarks/device/README.md)",
         f"2026-11-26, `{gpu}-cost-check`, `{gpu}-profiles`"],
        ["One H200: `--auto-parallel` on NCCL, a 1.28B GPT (Megatron's local layers) started, restarted from "
         "the cache, resumed with `--load`; the pick against typed micro-batches. **Held out** at the first start; "
         "the restart is priced with the job's own calibration from it",
         f"self-check measured/predicted x{job['first']['ratio']:.2f} at the first start (hook "
         f"{job['first']['hook_s']:.1f} s), x{job['cached']['ratio']:.2f} restarted with the calibration (hook "
         f"{job['cached']['hook_s']:.1f} s), x{job['resume']['ratio']:.2f} resumed at iteration "
         f"{job['resume']['first_iteration']}; with layers timed in chains, the pick (micro-batch 8) "
         f"{pick['first']['step_s']:.3f} s a step against {others}, uncalibrated self-checks {checks}",
         "`bash benchmarks/device/in_job.sh` on the GPU (benchmarks/device/README.md)",
         "2026-11-28, `h200-2026-11-28-in-job`, `h200-2026-11-28-chain-pick`"],
    ]


def table() -> str:
    lines = [BEGIN, "| compared against | figures | reproduce | when, kept under `benchmarks/results/` |",
             "|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows()]
    return "\n".join([*lines, END])


def readme_table(readme: str) -> str:
    """The table block of README.md's text ('' where it has none)."""
    if BEGIN not in readme or END not in readme:
        return ""
    return readme[readme.index(BEGIN):readme.index(END) + len(END)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when README.md's table is not this one")
    ns = p.parse_args(argv)
    if ns.check:
        same = readme_table((ROOT / "README.md").read_text()) == table()
        print("README.md's validation table is " + ("current" if same else "stale: regenerate it"))
        return 0 if same else 1
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
