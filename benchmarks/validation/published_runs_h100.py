"""Predict NVIDIA's published H100 runs at their own layouts and settings; print every row.

    python -m benchmarks.validation.published_runs_h100
        [--out benchmarks/results/published_runs_h100-DATE] [--no-search]

--out writes results.json (every row's prediction, breakdown and search) and table.md (the table
docs/validation.md shows).

Why: the planner is only worth trusting if it agrees with what NVIDIA runs today. The rows
(benchmarks/validation/published_runs_h100.json, a copy of the team's development set: NeMo 24.07,
Megatron-Bridge 25.09-26.04 and the Megatron-LM README's H100 table) give each run's model flags,
published layout, global batch, measured tokens/s/GPU, and the Megatron flags its recipe resolves
to (field `recipe`). Each row is priced the way a user would price it: `pipette estimate` (its
parser and functions, called in-process) with the published layout, the distributed optimizer and
the data-parallel overlaps every one of these runs used, the recipe's flags (and, for runs made from
a Megatron-Bridge recipe, the environment it sets: NVLS off, expandable allocator segments); then
`pipette plan` with the same model and settings and the layout's sizes free (the free search), for its
pick and predicted gain over the published layout.

What the free search keeps and frees (search_settings): it chooses TP, PP, CP, EP, ETP, the
micro-batch size, interleaving (VP), the pipeline split and recomputation (FREED); it keeps every other
layout setting of the published launch: the distributed optimizer, --overlap-grad-reduce,
--overlap-param-gather and sequence parallelism as constraints (valid on every layout; Megatron drops
sequence parallelism at TP 1), and the recipe's switches whose validity depends on the sizes
(--overlap-moe-expert-parallel-comm with --delay-wgrad-compute, Megatron-FSDP, CPU offloading,
--tp-comm-overlap, --cp-comm-type) as plan's `preferred`: on each candidate where Megatron accepts
them all, off where it does not (EP 1, PP without interleaving, full recomputation, ...), as a recipe
written for that layout would set them. Model flags (the dispatcher, precision, MTP, fusions) are the
workload's and stay as the recipe sets them. Where the recipe spells its own pipeline split or
recomputation (a --pipeline-model-parallel-layout, --recompute-modules), the search also tries them at
the PP and VP they are written for, the other sizes free (recipe_split), so the published layout is
always a candidate. The search runs once per distinct launch (model,
cluster, GPUs, precision, recipe flags, batch; `search`), which the releases of one recipe share.

Bars (issue: predictions that agree with what NVIDIA runs): mean |error| <= 10%, signed mean within
+-5%, no run beyond 25%; every published layout predicted to fit; MoE runs' median free-search gain
within 5%. Other published runs are kept apart and scored outside this repository.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from benchmarks.kept import keep
from megatron_pipette.cli.args import (
    DEFAULT_MODEL,
    check_megatron_flags,
    cluster_from_args,
    layout_constraints,
    split_megatron_flags,
    workload_from_args,
)
from megatron_pipette.cli.main import build_parser
from megatron_pipette.cost.execution import DEFAULT_EXECUTION, Execution
from megatron_pipette.cost.memory import TIGHT_HEADROOM, RuntimeOverheads, environment_overheads
from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import Infeasible, PipetteError
from megatron_pipette.plan.planner import evaluate, plan
from megatron_pipette.plan.search import PREFERABLE, RECOMPUTE_FLAGS, SPLIT_FLAGS
from megatron_pipette.spec.hardware import Cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout, check_user_layout
from megatron_pipette.spec.workload import Workload
from megatron_pipette.units import GiB

DATA = Path(__file__).with_name("published_runs_h100.json")
OVERLAPS = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
"""Every run of the set trained with the distributed optimizer and both data-parallel overlaps (the
NeMo and Megatron-Bridge defaults; the Megatron-LM README's runs name them in its scripts)."""
MEAN_BAR, SIGNED_BAR, WORST_BAR, GAIN_BAR = 0.10, 0.05, 0.25, 0.05
PRECISION = {"bf16": ["--bf16"], "fp8 hybrid, delayed scaling": ["--bf16", "--fp8-format", "hybrid",
                                                                    "--fp8-recipe", "delayed"]}


def base_argv(row: dict) -> list[str]:
    """The run's model, cluster, batch and precision flags."""
    return [*row["model_flags"], "--seq-length", str(row["seq_length"]),
            "--global-batch-size", str(row["global_batch_size"]), *PRECISION[row["precision"]],
            "--cluster", row["cluster"], "--num-nodes", str(row["gpus"] // row["gpus_per_node"]),
            "--gpus-per-node", str(row["gpus_per_node"])]


def recipe_flags(row: dict) -> tuple[list[str], list[str]]:
    """The recipe's Megatron flags the planner prices: the row's `megatron_flags`, and of the
    settings the set lists as not expressible (each "FLAGS: why"), those the planner now models;
    and the ones it still refuses, by their flags. Resolved once per row (every pricing of the row,
    and the fit's hundreds, reads them)."""
    flags, left = _recipe_flags(json.dumps(row, sort_keys=True))
    return list(flags), list(left)


PROVIDER_FLAGS = {
    "gpt_oss_120b_pretrain_64gpu_h100_bf16_config": [
        "--activation-func-clamp-value", "7.0", "--glu-linear-offset", "1.0",
        "--position-embedding-type", "yarn", "--rotary-scaling-factor", "32.0",
        "--yarn-original-max-position-embeddings", "4096", "--yarn-beta-fast", "32.0", "--yarn-beta-slow", "1.0",
        "--no-yarn-correction-range-round-to-int"],
}
"""Architecture settings of a recipe's model provider that the set's `recipe` field leaves out, as
Megatron flags (the set writes RoPE for GPT-OSS's YaRN; the later flag wins): Megatron-Bridge
0.6.2 builds GPT-OSS from its Hugging Face bridge (models/gpt_oss/gpt_oss_bridge.py:
activation_func_clamp_value 7.0, glu_linear_offset 1.0, position_embedding_type yarn with
yarn_rotary_scaling_factor 32.0, original max positions 4096, beta fast 32 and slow 1, no rounding
of the correction range, yarn_mscale and yarn_mscale_all_dim None, which give the concentration
factor Megatron's --mscale 1 and --mscale-all-dim 0 give)."""

RECIPE_LAYOUTS = {"deepseek_v3_pretrain_1024gpu_h100_fp8cs_config": "Et|(tt|)*30mL"}
"""A recipe's --pipeline-model-parallel-layout where it places layers the set's published layout
leaves out: Megatron-Bridge 0.6.2's DeepSeek-V3 recipe (perf_recipes/deepseek/h100/deepseek_v3.py)
puts its MTP layer (m) on the last stage, which the row's note records and its layout, written
when MTP could not be priced, omits. Used with the recipe's flags, which then include
--mtp-num-layers."""


def recipe_layout(row: dict) -> dict:
    """The published layout as the recipe spells it (RECIPE_LAYOUTS)."""
    spelt = RECIPE_LAYOUTS.get(row["recipe"]["function"])
    return row["published_layout"] if spelt is None else {**row["published_layout"],
                                                          "pipeline_model_parallel_layout": spelt}


@cache
def _recipe_flags(row_json: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    row = json.loads(row_json)
    flags = [*row["recipe"]["megatron_flags"], *PROVIDER_FLAGS.get(row["recipe"]["function"], [])]
    left = list(row["recipe"]["not_expressible"])
    while taken := [entry for entry in left if priced(row, flags, entry)]:   # one may need another
        flags += [word for entry in taken for word in entry.split(":")[0].split()]
        left = [entry for entry in left if entry not in taken]
    return tuple(flags), tuple(entry.split(":")[0] for entry in left)


def priced(row: dict, flags: list[str], entry: str) -> bool:
    """Whether the planner prices the published layout with the not-expressible `entry`'s flags added."""
    if not entry.startswith("--"):
        return False
    try:
        check_user_layout(Layout(**build(with_recipe(base_argv(row), [*flags, *entry.split(":")[0].split()])
                                         + layout_argv(recipe_layout(row))).fields))
    except (PipetteError, Infeasible):
        return False
    return True


def with_recipe(base: list[str], flags: list[str]) -> list[str]:
    """The row's flags with the recipe's added. The set writes --swiglu for the gated activation it
    could not express (GPT-OSS's: "the row prices SwiGLU"); the recipe's --quick-geglu replaces it
    (Megatron refuses the two together)."""
    if "--quick-geglu" in flags:
        base = [word for word in base if word != "--swiglu"]
    return [*base, *flags]


def model_argv(row: dict, recipe: bool) -> list[str]:
    """The run's flags, with its recipe's where `recipe`."""
    return with_recipe(base_argv(row), recipe_flags(row)[0] if recipe else [])


def layout_argv(layout: dict) -> list[str]:
    """The published layout as Megatron flags."""
    words = ["--tensor-model-parallel-size", str(layout["tp"]), "--pipeline-model-parallel-size", str(layout["pp"]),
             "--context-parallel-size", str(layout["cp"])]
    if layout["micro_batch_size"] is not None:
        words += ["--micro-batch-size", str(layout["micro_batch_size"])]
    if layout["ep"] > 1:
        words += ["--expert-model-parallel-size", str(layout["ep"])]
    if layout["etp"] is not None:
        words += ["--expert-tensor-parallel-size", str(layout["etp"])]
    if layout["num_layers_per_virtual_pipeline_stage"]:
        words += ["--num-layers-per-virtual-pipeline-stage", str(layout["num_layers_per_virtual_pipeline_stage"])]
    if layout["pipeline_model_parallel_layout"]:
        words += ["--pipeline-model-parallel-layout", layout["pipeline_model_parallel_layout"]]
    if layout["account_for_embedding_and_loss_in_pipeline_split"]:
        words += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    if layout["tp"] > 1:     # NeMo's and Megatron-Bridge's recipes turn sequence parallelism on with TP
        words += ["--sequence-parallel"]
    return words


@dataclass(frozen=True)
class Priced:
    """What the CLI would build from a row's flags: the model, the cluster, the typed layout."""

    workload: Workload
    cluster: Cluster
    fields: dict
    overheads: RuntimeOverheads


def environment(row: dict, recipe: bool) -> dict[str, str]:
    """The environment NVIDIA's Megatron-Bridge recipes launch with (COMMON_RECIPE_ENV_VARS: NVLS
    off, expandable allocator segments), for the rows run from one; the others' is not published."""
    if not recipe or row["recipe"]["function"] is None:
        return {}
    return {"NCCL_NVLS_ENABLE": "0", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def build(argv: list[str], env: dict[str, str] | None = None) -> Priced:
    """The row's flags read as `pipette estimate` reads them (its parser, its Megatron-flag check),
    in the job environment `env`."""
    ns, leftovers = build_parser().parse_known_args(["estimate", *argv])
    megatron, unknown = split_megatron_flags(leftovers)
    if unknown:
        raise PipetteError(f"not a Megatron flag: {' '.join(unknown)}")
    check_megatron_flags(megatron)
    workload = workload_from_args(ns, DEFAULT_MODEL)
    return Priced(workload=workload, cluster=cluster_from_args(ns, workload.precision, env or {}),
                  fields=layout_constraints(ns, workload.num_layers), overheads=environment_overheads(env or {}))


def with_execution(cluster: Cluster, step_fraction: float | None) -> Cluster:
    """The cluster with its GPU's step GEMM fraction replaced (for fitting it)."""
    if step_fraction is None:
        return cluster
    return dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, step_gemm_fraction=step_fraction))


def launch_argv(row: dict, recipe: bool) -> list[str]:
    """The launch a row's published layout is priced with (pinned), with its recipe's flags and layout
    spelling where `recipe`; the free search reads its settings from it too."""
    published = recipe_layout(row) if recipe else row["published_layout"]
    return [*model_argv(row, recipe), *layout_argv(published), *OVERLAPS]


def pinned(row: dict, recipe: bool, execution: Execution = DEFAULT_EXECUTION,
           step_fraction: float | None = None) -> dict:
    """Time and memory of the published layout; where its micro-batch size is not published, of
    the fastest fitting one (and interleaving) the search finds with the rest fixed."""
    try:
        priced = build(launch_argv(row, recipe), environment(row, recipe))
        model = CostModel(with_execution(priced.cluster, step_fraction), execution=execution,
                          overheads=priced.overheads)
        if row["published_layout"]["micro_batch_size"] is None:
            result = plan(priced.workload, model, constraints=priced.fields, top_k=1)
            if result.best is None:
                return {"error_message": "no layout fits"}
            time, memory = result.best.time, result.best.memory
        else:
            fields = priced.fields
            shards = fields["tensor_model_parallel_size"] * fields["pipeline_model_parallel_size"] * \
                fields["context_parallel_size"]
            layout = Layout(**fields, data_parallel_size=priced.cluster.world_size // shards)
            time, memory = evaluate(model, resolve_job(priced.workload, layout, priced.cluster.world_size))
    except (PipetteError, Infeasible) as e:
        return {"error_message": str(e)}
    return {"predicted_s": time.iteration_time_s, "error": time.iteration_time_s / row["iteration_time_s"] - 1,
            "fits": memory.fits, "peak_gib": memory.peak_bytes / GiB, "capacity_gib": memory.capacity_bytes / GiB,
            "headroom": 1 - memory.peak_bytes / memory.capacity_bytes, "breakdown_s": time.breakdown.as_dict()}


FREED = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
         "expert_model_parallel_size", "expert_tensor_parallel_size", "micro_batch_size",
         "num_layers_per_virtual_pipeline_stage", *SPLIT_FLAGS, *RECOMPUTE_FLAGS)
"""The layout's sizes, micro-batch, interleaving, pipeline split and recomputation: what the free search
chooses. Every other layout setting the run used (its recipe's and OVERLAPS) the search keeps
(search_settings)."""


def search_settings(fields: dict) -> tuple[dict, dict]:
    """The published launch's layout settings beyond FREED, as the search keeps them: (constraints,
    preferred). Those Megatron accepts on every layout (the distributed optimizer and its overlaps,
    sequence parallelism, which Megatron itself drops at TP 1) are constraints; those valid on some
    layouts only (--overlap-moe-expert-parallel-comm needs EP > 1 and, under PP, interleaving;
    --delay-wgrad-compute needs it; Megatron-FSDP and CPU offloading need PP 1, ...) are preferred: set
    together where Megatron accepts them, off where it does not, as a recipe written for that layout
    would set them (plan's `preferred`)."""
    kept = {name: value for name, value in fields.items() if name not in FREED}
    preferred = {name: value for name, value in kept.items() if name in PREFERABLE}
    return {name: value for name, value in kept.items() if name not in preferred}, preferred


RECIPE_SPLIT = ("pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage", *SPLIT_FLAGS,
                *RECOMPUTE_FLAGS)


def recipe_split(fields: dict) -> dict | None:
    """The published launch's pipeline split and recomputation, with the PP (and VP) the split is
    written for, where it sets either: the search tries them too, with every other size free. Why: its
    own splits (even, lighter first and last stages) and recomputations (none, core_attn, full) do not
    spell every recipe's (DeepSeek-V3's layout strings place the embedding and the MTP layer; its
    recipes recompute mla_up_proj), and without them the published layout itself is not a candidate, so
    a search could claim a loss against it. None where the launch sets neither."""
    if not any(name in fields for name in (*SPLIT_FLAGS, *RECOMPUTE_FLAGS)):
        return None
    return {name: fields[name] for name in RECIPE_SPLIT if name in fields}


def searched(row: dict, predicted_s: float | None, constraints: dict | None = None) -> dict:
    """The free search's pick for the row's model and settings (search_settings: the layout's sizes
    free), and its predicted gain over the published layout; `constraints` (Layout fields) pin part of
    the layout."""
    found = dict(search(tuple(launch_argv(row, recipe=True)), tuple(sorted(environment(row, True).items())),
                        tuple(sorted((constraints or {}).items()))))
    if "search_s" in found and predicted_s is not None:
        found["search_gain"] = predicted_s / found["search_s"] - 1
    return found




@cache
def search(argv: tuple[str, ...], env: tuple[tuple[str, str], ...], fixed: tuple[tuple[str, object], ...]) -> dict:
    """The free search for one launch (search_settings, with the `fixed` Layout fields; the better of it
    and the search with the recipe's split and recomputation, recipe_split), once per distinct launch:
    its pick depends on the model, cluster, settings and batch only, which many rows (the releases of
    one recipe) share."""
    try:
        priced = build(list(argv), dict(env))
        constraints, preferred = search_settings(priced.fields)
        model = CostModel(priced.cluster, overheads=priced.overheads)
        picks = [plan(priced.workload, model, constraints={**constraints, **split, **dict(fixed)},
                      preferred=preferred, top_k=1).best for split in ({}, recipe_split(priced.fields))
                 if split is not None]
    except (PipetteError, Infeasible) as e:
        return {"search_error": str(e)}
    if not any(picks):
        return {"search_error": "no layout fits"}
    best = min((pick for pick in picks if pick), key=lambda pick: pick.time.iteration_time_s)
    # The pick's memory beside the published layout's: a pick within the memory model's own error of
    # the capacity (TIGHT_HEADROOM) claims a gain over a run that is known to fit.
    return {"search_s": best.time.iteration_time_s, "search_layout": " ".join(best.layout.megatron_args()),
            "search_breakdown_s": best.time.breakdown.as_dict(), "search_kept": {**constraints, **preferred},
            "search_peak_gib": best.memory.peak_bytes / GiB, "search_headroom": best.memory.headroom}


NAMED_GAIN = 0.10
"""A free search's predicted gain over a published layout above which the report names the time
terms it comes from (issue 31: the gain over NVIDIA's MoE layouts should stay under 10%)."""


def gain_terms(published: dict, found: dict) -> list[tuple[str, float]]:
    """Where the search claims more than NAMED_GAIN over the published layout: the time terms (seconds
    of TimeBreakdown) that the searched layout saves, largest first, those under 5% of the gap left
    out. Why: a claimed gain is either the model's error on one term or a better layout; the term
    says which to look at."""
    if found.get("search_gain", 0.0) <= NAMED_GAIN or "breakdown_s" not in published:
        return []
    saved = {term: published["breakdown_s"][term] - found["search_breakdown_s"][term]
             for term in published["breakdown_s"]}
    gap = published["predicted_s"] - found["search_s"]
    return sorted(((t, s) for t, s in saved.items() if s > 0.05 * gap), key=lambda ts: -ts[1])


def describe_gain(terms) -> str:
    """The gain's terms as the report prints them ("ep_comm -2.71 s, compute -0.40 s")."""
    return ", ".join(f"{t.removesuffix('_s')} -{s:.2f} s" for t, s in terms)


def summary(rows: list[dict], key: str) -> dict:
    priced = [r[key] for r in rows if "error" in r[key]]
    errors = np.array([p["error"] for p in priced])
    gains = [r["search"]["search_gain"] for r in rows if r["moe"] and "search_gain" in r.get("search", {})]
    at_mbs = [r["search"]["at_published_mbs"]["search_gain"] for r in rows
              if "search_gain" in r.get("search", {}).get("at_published_mbs", {})]
    return {"runs": len(rows), "priced": len(priced), "mean_abs_error": float(np.abs(errors).mean()),
            "mean_error": float(errors.mean()), "worst_error": float(errors[np.argmax(np.abs(errors))]),
            "beyond_25pct": int((np.abs(errors) > WORST_BAR).sum()),
            "predicted_not_to_fit": sum(not p["fits"] for p in priced),
            "fits_within_2pct": sum(p["fits"] and p["headroom"] < 0.02 for p in priced),
            "moe_median_search_gain": float(np.median(gains)) if gains else None,
            "moe_search_picks_within_2pct": sum(r["search"]["search_headroom"] < TIGHT_HEADROOM for r in rows
                                                if r["moe"] and "search_headroom" in r.get("search", {})),
            "moe_median_search_gain_at_published_mbs": float(np.median(at_mbs)) if at_mbs else None}


def markdown_table(rows: list[dict]) -> str:
    """The rows as docs/validation.md shows them."""
    lines = ["| run | measured s | error, layout and overlaps only | predicted s, with the recipe | error | "
             "peak GiB (fits) | free search's predicted gain |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p, s = r["recipe"], r["search"]
        if "error" not in p:
            lines.append(f"| {r['id']} | {r['measured_s']:.3f} | | {p['error_message']} | | | |")
            continue
        fits = "tight" if p["fits"] and p["headroom"] < 0.02 else "yes" if p["fits"] else "NO"
        gain = f"{s['search_gain']:+.1%}" if "search_gain" in s else "-"
        if "search_gain" in s.get("at_published_mbs", {}):
            gain += f" ({s['at_published_mbs']['search_gain']:+.1%} at its micro-batch size)"
        plain = f"{r['plain']['error']:+.1%}" if "error" in r["plain"] else "-"
        lines.append(f"| {r['id']} | {r['measured_s']:.3f} | {plain} | {p['predicted_s']:.3f} | {p['error']:+.1%} | "
                     f"{p['peak_gib']:.1f} ({fits}) | {gain} |")
    return "\n".join(lines) + "\n"


def is_moe(row: dict) -> bool:
    return "--num-experts" in row["model_flags"] or "deepseek-v3-like" in row["model_flags"]


def result_row(row: dict, search: bool = True) -> dict:
    """The row as results.json keeps it: priced without and with its recipe and, with `search`,
    the free search's pick."""
    plain, recipe = pinned(row, recipe=False), pinned(row, recipe=True)
    found = searched(row, recipe.get("predicted_s")) if search else {}
    if found and is_moe(row) and row["published_layout"]["micro_batch_size"] is not None:
        # How much of the gain is the micro-batch (per-micro-batch costs amortised) and how much
        # the rest of the layout: the search again with the published micro-batch size.
        published = {"micro_batch_size": row["published_layout"]["micro_batch_size"]}
        found["at_published_mbs"] = searched(row, recipe.get("predicted_s"), published)
    for pick in (found, found.get("at_published_mbs", {})):
        if terms := gain_terms(recipe, pick):
            pick["gain_terms_s"] = dict(terms)
    flags, not_priced = recipe_flags(row)
    return {"id": row["id"], "measured_s": row["iteration_time_s"], "moe": is_moe(row), "plain": plain,
            "recipe": recipe, "search": found, "recipe_flags": flags, "recipe_not_priced": not_priced}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for results.json (default: print only)")
    p.add_argument("--no-search", action="store_true", help="skip the free search (faster)")
    ns = p.parse_args(argv)
    rows = []
    print(f"{'run':<26} {'measured s':>10} {'no recipe':>9} {'predicted s':>11} {'error':>7} "
          f"{'peak GiB':>8}  {'search gain':>11}  search pick")
    for row in json.loads(DATA.read_text())["rows"]:
        rows.append(result_row(row, search=not ns.no_search))
        plain, recipe, search = rows[-1]["plain"], rows[-1]["recipe"], rows[-1]["search"]
        if "error" not in recipe:
            print(f"{row['id']:<26} {row['iteration_time_s']:>10.3f}  {recipe['error_message']}")
            continue
        fits = " OOM" if not recipe["fits"] else " <2%" if recipe["headroom"] < 0.02 else ""
        gain = f"{search['search_gain']:+.1%}" if "search_gain" in search else search.get("search_error", "")
        if search.get("search_headroom", 1.0) < TIGHT_HEADROOM:
            gain += " (pick <2%)"
        unpriced = f"{plain['error']:+.1%}" if "error" in plain else "-"
        print(f"{row['id']:<26} {row['iteration_time_s']:>10.3f} {unpriced:>9} "
              f"{recipe['predicted_s']:>11.3f} {recipe['error']:>+7.1%} {recipe['peak_gib']:>7.1f}{fits:<4} "
              f"{gain:>11}  {search.get('search_layout', '')}", flush=True)
        if "gain_terms_s" in search:
            print(f"{'':<26} {'':>61}  the gain from: {describe_gain(search['gain_terms_s'].items())}")
        if "search_gain" in search.get("at_published_mbs", {}):
            at = search["at_published_mbs"]
            print(f"{'':<26} {'':>10} {'':>9} {'':>11} {'':>7} {'':>8}  {at['search_gain']:>+11.1%}  "
                  f"(the published micro-batch size) {at['search_layout']}", flush=True)
            if "gain_terms_s" in at:
                print(f"{'':<26} {'':>61}  the gain from: {describe_gain(at['gain_terms_s'].items())}")
    result = {"date": datetime.date.today().isoformat(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "bars": {"mean_abs_error": MEAN_BAR, "signed_mean": SIGNED_BAR, "worst": WORST_BAR,
                       "moe_median_search_gain": GAIN_BAR},
              "summary": {k: summary(rows, k) for k in ("plain", "recipe")}, "rows": rows}
    for name, s in result["summary"].items():
        median = s["moe_median_search_gain"]
        at_mbs = s["moe_median_search_gain_at_published_mbs"]
        gain = "" if median is None else f", MoE median search gain {median:+.1%}" + (
            "" if at_mbs is None else f" ({at_mbs:+.1%} at the published micro-batch sizes)") + (
            f", {s['moe_search_picks_within_2pct']} of its picks within 2% of capacity")
        print(f"{name:>7}: {s['priced']}/{s['runs']} priced, mean |error| {s['mean_abs_error']:.1%} "
              f"(signed {s['mean_error']:+.1%}), worst {s['worst_error']:+.1%}, {s['beyond_25pct']} beyond 25%, "
              f"{s['predicted_not_to_fit']} predicted not to fit, {s['fits_within_2pct']} within 2% of capacity{gain}")
    if ns.out:
        (keep(ns.out, result) / "table.md").write_text(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
