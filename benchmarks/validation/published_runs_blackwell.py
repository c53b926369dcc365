"""Price NVIDIA's published Blackwell runs at their own layouts with the planner as it stands; print every row.

    python -m benchmarks.validation.published_runs_blackwell
        [--out benchmarks/results/published_runs_blackwell-DATE] [--search [--moe-only]]
    python -m benchmarks.validation.published_runs_blackwell --resolve WHEEL_DIR

Why: the baseline of issue 31 (Blackwell priced from evidence). The rows
(benchmarks/validation/published_runs_blackwell.json, a copy of the team's Blackwell development set: Megatron-Bridge
25.09-26.08 on DGX-B200, DGX-B300, GB200 and GB300 NVL72) give each run's model, published layout,
precision, global batch and measured tokens/s/GPU. Each row is priced as published_runs_h100.py prices
its rows (its functions: the same parser, overlaps, recipe environment and pricing), with the launch
written as the recipes write it: the precision's Megatron flags (--fp8-recipe mxfp8, --fp4-recipe
nvfp4, ...), --num-virtual-stages-per-pipeline-rank for VP, --use-megatron-fsdp for the tables' FSDP
column, the cluster named by the row. What the planner refuses is listed with its reason.

--resolve WHEEL_DIR (an unpacked megatron-bridge wheel) writes each row's `recipe` (the H100 set's
shape) from perf_recipes/<model>/<gpu>/ by reading the recipe functions' assignments (no import: the
wheel needs a GPU stack); each recipe setting that names a Megatron argument becomes a candidate flag,
priced where the planner prices it; the rest is listed as not known or not expressible. The recipes
read are of the 26.08 era, whatever the set's `about` says (the 25.11-26.02 era): the registry's wheels
were built 0.3.0 2026-02-26, 0.4.0 04-16, 0.5.0 06-22, 0.6.0 08-20 (the first with perf_recipes/; the
earlier ones ship none) and 0.6.2 09-18, one a container release (26.02 ... 26.08), so every row before
26.08 ran an older recipe than the one read.

No tuning: this prices the rows with the cost model and catalog as they are.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmarks.kept import keep
from benchmarks.validation.published_runs_h100 import (
    WORST_BAR,
    base_argv,
    build,
    describe_gain,
    is_moe,
    layout_argv,
    result_row,
    summary,
)
from benchmarks.validation.release_steps import ANOTHER_RECIPE, RELEASE_STEP, STEP_ELSEWHERE, explanations
from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.megatron_flags import flag_table

DATA = Path(__file__).with_name("published_runs_blackwell.json")

PRECISION = {
    "bf16": [],
    "fp8 current scaling (tensorwise)": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "fp8 (as published; the 26.x Llama recipes use current scaling)": ["--fp8-format", "hybrid",
                                                                       "--fp8-recipe", "tensorwise"],
    None: ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "mxfp8": ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"],
    "nvfp4": ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"],
}
"""Each published precision as Megatron flags (on top of --bf16), as Megatron-Bridge 0.6.2's
training/mixed_precision.py sets them: current scaling fp8 "hybrid" with recipe "tensorwise"
(bf16_with_fp8_current_scaling_mixed), MXFP8 fp8 "e4m3" with recipe "mxfp8" (bf16_with_mxfp8_mixed),
NVFP4 fp4 "e2m1" with recipe "nvfp4" (bf16_with_nvfp4_mixed). The 25.09 table has no precision
column (None): its release notes say FP8 current scaling."""

RECIPE_PRECISION = {"bf16": "bf16", "fp8 current scaling (tensorwise)": "fp8cs", None: "fp8cs",
                    "fp8 (as published; the 26.x Llama recipes use current scaling)": "fp8cs",
                    "mxfp8": "fp8mx", "nvfp4": "nvfp4"}
"""The perf recipe's function-name suffix for each published precision."""

STAND_IN = {"cluster": {"gb300-nvl72": "gb200-nvl72"}, "precision": PRECISION["fp8 current scaling (tensorwise)"]}
"""What a refused setting is replaced by when looking for a row's further refusals (only there)."""


def launch(row: dict) -> dict[str, list[str]]:
    """The row's launch settings beyond model and layout, each as Megatron words."""
    layout = row["published_layout"]
    vp = layout["virtual_stages_per_pipeline_rank"]
    return {"cluster": ["--cluster", row["cluster"]], "precision": PRECISION[row["precision"]],
            "split": split_argv(row, vp),
            "fsdp": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
            if fsdp(layout) else []}


def split_argv(row: dict, vp: int | None) -> list[str]:
    """The pipeline split as the row's recipe sets it (--resolve's `pipeline_split`: the embedding and
    loss counted, or a --pipeline-model-parallel-layout, which spells VP itself), with the published VP."""
    split = (row.get("recipe") or {}).get("pipeline_split", {}).get("flags", [])
    if "--pipeline-model-parallel-layout" in split:
        return split
    return [*(["--num-virtual-stages-per-pipeline-rank", str(vp)] if vp and vp > 1 else []), *split]


def fsdp(layout: dict) -> bool:
    """Whether the table's FSDP column says on: 64 in 25.09/25.11 (a cell "64 (0)" keeps its first
    figure), 0 or absent for off."""
    return str(layout["fsdp"]).split()[0] not in ("0", "None")


def as_h100_row(row: dict, settings: dict[str, list[str]] | None = None) -> dict:
    """The row in the H100 set's shape, so that published_runs_h100's functions price it:
    precision, VP and FSDP go into the launch flags, the cluster into `cluster`."""
    settings = settings or launch(row)
    layout = row["published_layout"]
    return {**row, "cluster": settings["cluster"][1], "precision": "bf16",
            "model_flags": [*row["model_flags"], *settings["precision"], *settings["split"], *settings["fsdp"]],
            "published_layout": {"tp": layout["tp"], "pp": layout["pp"], "cp": layout["cp"], "ep": layout["ep"] or 1,
                                 "etp": layout["etp"], "micro_batch_size": layout["micro_batch_size"],
                                 "num_layers_per_virtual_pipeline_stage": None,
                                 "pipeline_model_parallel_layout": None,
                                 "account_for_embedding_and_loss_in_pipeline_split": False},
            "recipe": joined(row.get("recipe") or {"function": None, "megatron_flags": [], "not_expressible": []})}


TOGETHER = ("--fp8-param-gather", "--reuse-grad-buf-for-mxfp8-param-ag")
"""Recipe settings taken only together: _perf_precision("fp8_mx") sets both (MIXED_PRECISION), megatron-core
asserts the second only with the first (distributed_data_parallel_config.py), and the planner prices
MXFP8's parameter gather with both (docs/fp8.md)."""


def joined(recipe: dict) -> dict:
    """The recipe with its TOGETHER settings as one not-expressible entry, so that they are priced (or
    left) together: published_runs_h100.recipe_flags tries one entry at a time."""
    entries = recipe["not_expressible"]
    parts = [next((e for e in entries if e.split(":")[0].split() == [flag]), None) for flag in TOGETHER]
    if None in parts:
        return recipe
    whole = f"{' '.join(TOGETHER)}: " + "; ".join(e.split(":", 1)[1].strip() for e in parts)
    return {**recipe, "not_expressible": [whole if e == parts[0] else e for e in entries if e != parts[1]]}


def refusals(row: dict) -> list[str]:
    """Every launch setting of the row the planner refuses, with its message: the refused setting (the
    one whose flag the message names) is replaced by a priced stand-in (STAND_IN, or dropped) and the
    row read again."""
    settings, found = launch(row), []
    while True:
        h100 = as_h100_row(row, settings)
        try:
            build([*base_argv(h100), *layout_argv(h100["published_layout"])])
            return found
        except PipetteError as e:
            found.append(str(e))
            flag = reason(str(e)).split()[0]
            named = [key for key, words in settings.items() if flag in words]
            if not named:
                return found
            key = named[0]
            settings[key] = ["--cluster", STAND_IN["cluster"].get(row["cluster"], row["cluster"])] \
                if key == "cluster" else STAND_IN["precision"] if key == "precision" else []


def reason(message: str) -> str:
    """A refusal's reason, by the flag (and value) it names."""
    flag = re.search(r"--[a-z0-9-]+", message)
    value = re.search(r"'([^']+)'", message) if flag and flag.group() in ("--cluster", "--fp8-recipe") else None
    return (flag.group() if flag else message) + (f" {value.group(1)}" if value else "")


def tokens_per_gpu(row: dict, seconds: float) -> float:
    return row["global_batch_size"] * row["seq_length"] / (seconds * row["gpus"])


def priced_row(row: dict, search: bool) -> dict:
    """The row as results.json keeps it: published_runs_h100.result_row of the row in its shape, the
    predicted tokens/s/GPU, and every refused launch setting."""
    out = result_row(as_h100_row(row), search=search)
    out.update(label=row["label"], cluster=row["cluster"], gpus=row["gpus"], precision=row["precision"],
               measured_tokens_per_s_per_gpu=row["tokens_per_s_per_gpu"],
               recipe_function=row.get("recipe", {}).get("function"),
               recipe_note=row.get("recipe", {}).get("note"))
    for key in ("plain", "recipe"):
        if "predicted_s" in out[key]:
            out[key]["predicted_tokens_per_s_per_gpu"] = tokens_per_gpu(row, out[key]["predicted_s"])
    out["refused"] = refusals(row) if "error" not in out["recipe"] else []
    out["not_known"] = not_known(row, out["recipe"].get("error_message"))
    return out


def search_medians(s: dict) -> str:
    """The summary's MoE median search gains as the report prints them (nothing without a search)."""
    median, at_mbs = s["moe_median_search_gain"], s["moe_median_search_gain_at_published_mbs"]
    if median is None:
        return ""
    return f", MoE median search gain {median:+.1%}" + (
        "" if at_mbs is None else f" ({at_mbs:+.1%} at the published micro-batch sizes)")


def explanation(row: dict) -> str:
    """A priced row's explanation (release_steps) as the report prints it."""
    why = row["explained"]
    return f"{why['kind']}: {why['why']}" if why else "unexplained"


def not_known(row: dict, refusal: str | None) -> str | None:
    """Why the row's settings are not known, where the planner refuses them by a rule of Megatron's
    (Megatron would refuse the launch as read too) and the recipe's pipeline split is not the run's
    (pipeline_split's `not_known`): the run's release set something 0.6.2 does not say."""
    split = (row.get("recipe") or {}).get("pipeline_split", {}).get("not_known")
    if refusal is None or split is None or not refusal.endswith("Megatron's rule)"):
        return None
    return f"{split}; as read, {refusal}"


def refusal_counts(rows: list[dict]) -> dict:
    """Refused rows counted by their first refusal's reason, and rows counted by every reason they have
    (rows whose settings are not known are not refusals: counted apart)."""
    first, every = {}, {}
    for r in rows:
        if "error" in r["recipe"] or r.get("not_known"):
            continue
        key = reason(r["recipe"]["error_message"])
        first[key] = first.get(key, 0) + 1
        for message in {reason(m) for m in r["refused"]} or {key}:
            every[message] = every.get(message, 0) + 1
    return {"by_first_reason": first, "by_every_reason": every}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for results.json (default: print only)")
    p.add_argument("--search", action="store_true", help="also run the free search on each priced row (slow)")
    p.add_argument("--moe-only", action="store_true", help="with --search: search the MoE rows only")
    p.add_argument("--resolve", metavar="WHEEL_DIR",
                   help="write the rows' `recipe` from an unpacked megatron-bridge wheel, then stop")
    ns = p.parse_args(argv)
    doc = json.loads(DATA.read_text())
    if ns.resolve:
        for row in doc["rows"]:
            row["recipe"] = resolve_recipe(row, Path(ns.resolve) / "megatron" / "bridge" / "perf_recipes")
        doc["recipe_about"] = ("each row's `recipe` was added to the team's set by published_runs_blackwell.py "
                               "--resolve from the megatron-bridge 0.6.2 wheel's perf_recipes/ (the rest is the set as "
                               "given): its function, candidate Megatron flags, its pipeline split (pipeline_split, "
                               "from the perf recipe and the base recipe it starts from), what was not read "
                               "(not_known) and settings with no Megatron 0.19.2 flag")
        DATA.write_text(json.dumps(doc, indent=1) + "\n")
        return 0
    rows = []
    print(f"{'run':<46} {'measured tok/s/GPU':>18} {'predicted':>9} {'error':>7} {'peak GiB':>9}  refused / search")
    for row in doc["rows"]:
        rows.append(priced_row(row, ns.search and (not ns.moe_only or is_moe(as_h100_row(row)))))
        recipe = rows[-1]["recipe"]
        if rows[-1]["not_known"]:
            print(f"{row['id']:<46} {row['tokens_per_s_per_gpu']:>18,}  not known: {rows[-1]['not_known']}",
                  flush=True)
            continue
        if "error" not in recipe:
            print(f"{row['id']:<46} {row['tokens_per_s_per_gpu']:>18,}  refused: "
                  f"{'; '.join(rows[-1]['refused']) or recipe['error_message']}", flush=True)
            continue
        fits = " OOM" if not recipe["fits"] else " <2%" if recipe["headroom"] < 0.02 else ""
        search = rows[-1]["search"]
        gain = f"search {search['search_gain']:+.1%} {search['search_layout']}" if "search_gain" in search else ""
        print(f"{row['id']:<46} {row['tokens_per_s_per_gpu']:>18,} {recipe['predicted_tokens_per_s_per_gpu']:>9,.0f} "
              f"{recipe['error']:>+7.1%} {recipe['peak_gib']:>7.1f}{fits:<4} {gain}", flush=True)
        for pick, what in ((search, ""), (search.get("at_published_mbs", {}), "at the published micro-batch size ")):
            if "search_gain" in pick and pick is not search:
                print(f"{'':<46} {'':>18} {'':>9} {'':>7} {'':>9}  search {what}{pick['search_gain']:+.1%} "
                      f"{pick['search_layout']}", flush=True)
            if "gain_terms_s" in pick:
                print(f"{'':<46} {'':>48}the gain from: {describe_gain(pick['gain_terms_s'].items())}", flush=True)
    for row, why in zip(rows, explanations(doc["rows"], [as_h100_row(r) for r in doc["rows"]], rows)):
        row["explained"] = None if why is None else {"kind": why[0], "why": why[1]}
    counts = refusal_counts(rows)
    result = {"date": datetime.date.today().isoformat(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
              "error_sign": "predicted step time / measured - 1: positive is predicted too slow",
              "summary": {k: summary(rows, k) for k in ("plain", "recipe")}, "refusals": counts, "rows": rows}
    beyond = [r for r in rows if abs(r["recipe"].get("error", 0)) > WORST_BAR]
    result["summary"]["recipe"].update(
        beyond_25pct_unexplained=sum(not r["explained"] for r in beyond),
        **{f"beyond_25pct_{kind.replace(' ', '_')}": sum(bool(r["explained"]) and r["explained"]["kind"] == kind
                                                       for r in beyond)
           for kind in (RELEASE_STEP, STEP_ELSEWHERE, ANOTHER_RECIPE)})
    too_big = [r for r in rows if r["recipe"].get("fits") is False]
    result["summary"]["recipe"].update(not_fit_another_recipe=sum(bool(r["explained"]) for r in too_big),
                                       not_fit_unexplained=sum(not r["explained"] for r in too_big))
    for name, s in result["summary"].items():
        print(f"{name:>7}: {s['priced']}/{s['runs']} priced, mean |error| {s['mean_abs_error']:.1%} "
              f"(signed {s['mean_error']:+.1%}), worst {s['worst_error']:+.1%}, {s['beyond_25pct']} beyond "
              f"{WORST_BAR:.0%}, {s['predicted_not_to_fit']} predicted not to fit, {s['fits_within_2pct']} within 2% "
              f"of capacity" + search_medians(s))
    s = result["summary"]["recipe"]
    print(f"beyond {WORST_BAR:.0%} with the recipe: {s['beyond_25pct_release_step']} explained by a release step, "
          f"{s['beyond_25pct_release_step_elsewhere']} by one on another system, "
          f"{s['beyond_25pct_another_recipe']} run from another recipe than 0.6.2's, {s['beyond_25pct_unexplained']} "
          "unexplained (release_steps)")
    for row in beyond:
        print(f"  {row['id']} {row['recipe']['error']:+.1%}: {explanation(row)}")
    print(f"predicted not to fit with the recipe: {s['not_fit_another_recipe']} run from another recipe than 0.6.2's, "
          f"{s['not_fit_unexplained']} unexplained")
    for row in too_big:
        print(f"  {row['id']} {row['recipe']['peak_gib']:.1f} of {row['recipe']['capacity_gib']:.1f} GiB: "
              f"{explanation(row)}")
    print("refused, by first reason: " + ", ".join(f"{k} {v}" for k, v in sorted(counts["by_first_reason"].items())))
    print("refused, by every reason: " + ", ".join(f"{k} {v}" for k, v in sorted(counts["by_every_reason"].items())))
    print(f"not known (the recipe as read is refused by Megatron too): {sum(bool(r['not_known']) for r in rows)}")
    if ns.out:
        keep(ns.out, result)
    return 0


# --- the recipes, read from the wheel's source (--resolve) ---

MODELS = {"LLAMA3_8B": ("llama", "llama3_8b"), "LLAMA3_70B": ("llama", "llama3_70b"),
          "LLAMA3.1_405B": ("llama", "llama31_405b"), "DeepSeekV3": ("deepseek", "deepseek_v3"),
          "Qwen3_30B_a3B": ("qwen", "qwen3_30b_a3b")}
"""The tables' model names: the perf_recipes folder and the recipe functions' prefix."""

LAYOUT_SETTINGS = {"model.tensor_model_parallel_size": "TP", "model.pipeline_model_parallel_size": "PP",
                   "model.context_parallel_size": "CP", "model.virtual_pipeline_model_parallel_size": "VP",
                   "model.expert_model_parallel_size": "EP", "model.expert_tensor_parallel_size": "ETP",
                   "train.micro_batch_size": "MBS", "train.global_batch_size": "GBS"}
"""Recipe settings the row's published layout gives (compared in the note, not taken as flags)."""

NOT_MEGATRON = ("dataset.", "tokenizer.", "checkpoint.", "logger.", "scheduler.", "rerun_state_machine.",
                "env_vars", "train.train_iters", "train.eval_iters", "peft.", "model.sequence_parallel",
                "model.should_pad_vocab", "mixed_precision.fp8", "mixed_precision.fp8_recipe",
                "mixed_precision.fp4", "mixed_precision.fp4_recipe", "model.seq_length")
"""Recipe settings with no Megatron training flag to price, or given by the row (sequence parallelism
with TP, the precision, the sequence length)."""

ARGUMENT = {"rng.te_rng_tracker": "te_rng_tracker", "model.use_te_rng_tracker": "te_rng_tracker",
            "dist.enable_megatron_core_experimental": "enable_experimental",
            "model.cuda_graph_scope": "cuda_graph_modules", "model.bias_activation_fusion": "bias_swiglu_fusion",
            "ddp.check_for_nan_in_grad": "check_for_nan_in_loss_and_grad"}
"""Recipe settings whose Megatron 0.19.2 argument has another name (--cuda-graph-scope is deprecated
for --cuda-graph-modules; the models here are all SwiGLU, whose bias fusion is --no-bias-swiglu-fusion)."""

MIXED_PRECISION = {"bf16": {}, "fp8cs": {"mixed_precision.fp8_param_gather": True},
                   "fp8mx": {"mixed_precision.fp8_param_gather": True,
                             "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag": True},
                   "nvfp4": {"mixed_precision.fp4_param_gather": True}}
"""What _perf_precision(dtype) sets beyond the precision itself (training/mixed_precision.py of 0.6.2)."""

PRECISION_SUFFIX = {"bf16": "bf16", "fp8_cs": "fp8cs", "fp8_mx": "fp8mx", "nvfp4": "nvfp4"}

SPLIT = {"model.account_for_embedding_in_pipeline_split": "--account-for-embedding-in-pipeline-split",
         "model.account_for_loss_in_pipeline_split": "--account-for-loss-in-pipeline-split",
         "model.num_layers_in_first_pipeline_stage": "--decoder-first-pipeline-num-layers",
         "model.num_layers_in_last_pipeline_stage": "--decoder-last-pipeline-num-layers",
         "model.pipeline_model_parallel_layout": "--pipeline-model-parallel-layout"}
"""The recipe settings that split the layers over the pipeline, and Megatron 0.19.2's flag for each
(Bridge's TransformerConfig names the first/last stage's layers num_layers_in_first/last_pipeline_stage).
They are read from the base recipe a perf recipe starts from as well (only these: the base is an H100
recipe whose other settings the perf recipe overrides or the row does not say)."""

MTP = "model.mtp_num_layers"
"""Read with the split: a layout places the MTP layers (m), and Megatron requires as many as
--mtp-num-layers says (the DeepSeek-V3 base recipe sets 1)."""

LAYOUT_FUNCTION = "set_deepseek_v3_pipeline_model_parallel_layout"
"""The helper that sets DeepSeek-V3's --pipeline-model-parallel-layout from PP, VP and the MTP depth (or a
given layout); run from the wheel's source at the row's published PP and VP (layout_from_function)."""

DISPATCHER = ("model.moe_token_dispatcher_type", "model.moe_flex_dispatcher_backend")
"""The token dispatcher, read from the base recipe as well: a perf recipe that sets none (the B200
DeepSeek-V3 ones) runs the base's, which FLEX_FUNCTION at the base's end makes flex on Blackwell."""

FLEX_FUNCTION = "apply_flex_dispatcher_backend"
"""Megatron-Bridge 0.6.2's training/flex_dispatcher_backend.py: the flex dispatcher with the given backend
where the job's GPU takes it, else alltoall with no backend; decided per row (dispatcher_on)."""

ARCHITECTURE = {"DeepSeekV3": "--moe-router-num-groups 8 --moe-router-group-topk 4: DeepSeek-V3's config.json "
                              "(n_group 8, topk_group 4), which Megatron-Bridge 0.6.2 maps to moe_router_num_groups "
                              "and moe_router_group_topk (models/conversion/model_bridge.py)"}
"""Architecture settings of a table's model that its recipe takes from the Hugging Face config, not from
perf_recipes/ (the deepseek-v3-like preset leaves node-limited routing out), as a recipe entry."""

PROVIDER_DEFAULTS = ["--cross-entropy-loss-fusion: GPTModelProvider.cross_entropy_loss_fusion = True "
                     "(models/gpt_provider.py), which 0.6.2's pretrain recipes leave on (only PEFT ones turn it off)"]
"""Settings every recipe's model provider defaults to where Megatron's default differs and no perf
recipe assigns them, as recipe entries: Megatron-LM's --cross-entropy-loss-fusion is off by default,
Megatron-Bridge's GPT provider has it on, so the recipes' cross_entropy_fusion_impl (te, set by
perf_recipes/_common.py) is the loss they run."""

NOTHING_RECOMPUTED = {"model.recompute_granularity": "selective", "model.recompute_modules": []}
"""A recipe's selective recomputation of no module (the GB300 DeepSeek-V3 FP8/FP4 ones: the common
settings' "selective", then recompute_modules = []): TransformerConfig recomputes nothing with an empty
list (it fills in core_attn only for None), and Megatron-LM cannot say it (--recompute-modules takes at
least one module; without it, core_attn), so its launch has no --recompute-granularity."""

LAYER_LETTERS = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
"""A layout's list-of-lists layer names as megatron-core's string letters (PipelineParallelLayerLayout)."""


def resolve_recipe(row: dict, root: Path) -> dict:
    """The row's recipe in the H100 set's shape: the 0.6.2 perf recipe function for its model, GPU,
    precision and GPU count (or the nearest GPU count, said in the note), its settings as candidate
    Megatron flags (`not_expressible`, each "FLAGS: from where"), and what could not be read."""
    label = row["label"].split()[1]
    folder, prefix = MODELS[label]
    gpu = row["system"].removeprefix("DGX-").lower()
    suffix = RECIPE_PRECISION[row["precision"]]
    functions = recipe_functions(root, folder, gpu)
    pattern = re.compile(rf"{prefix}_pretrain_(\d+)gpu_{gpu}_{suffix}_config$")
    counts = sorted(int(m.group(1)) for name in functions if isinstance(name, str) and (m := pattern.match(name)))
    if not counts:
        return {"function": None, "megatron_flags": [], "not_expressible": [],
                "note": f"no megatron-bridge 0.6.2 perf recipe {prefix}_pretrain_*gpu_{gpu}_{suffix}_config"}
    count = min(counts, key=lambda n: (abs(n - row["gpus"]), n))
    name = f"{prefix}_pretrain_{count}gpu_{gpu}_{suffix}_config"
    settings, unknown = {}, []
    interpret(functions, name, {}, settings, unknown)
    split = pipeline_split(row, settings, root)
    if all(settings.get(path) == value for path, value in NOTHING_RECOMPUTED.items()):
        for path in NOTHING_RECOMPUTED:
            del settings[path]
    if isinstance(flex := settings.get(DISPATCHER[0]), dict):
        if not dispatcher_on(gpu, flex["flex"]):
            settings[DISPATCHER[0]], settings[DISPATCHER[1]] = "alltoall", None
        else:
            settings[DISPATCHER[0]] = "flex"
    if row["published_layout"]["tp"] < 2:      # Bridge's CommOverlapConfig turns it off below TP 2
        settings.pop("comm_overlap.tp_comm_overlap", None)    # (training/comm_overlap.py lines 442-445)
        settings.pop("comm_overlap.tp_comm_overlap_cfg", None)
    entries, flagless = [], []
    for path, value in settings.items():
        if path in LAYOUT_SETTINGS or path in SPLIT or path == MTP or (path.startswith(NOT_MEGATRON)
                                                        and not path.endswith("_param_gather")):
            continue
        words = megatron_words(path, value)
        if words is None:
            flagless.append(f"{path} = {value!r}")
        elif words:
            entries.append(f"{' '.join(words)}: {path} = {value!r} ({name})")
    entries += PROVIDER_DEFAULTS
    if label in ARCHITECTURE:
        entries.append(ARCHITECTURE[label])
    layout = {key: settings[path] for path, key in LAYOUT_SETTINGS.items() if path in settings}
    recipe_layout = " ".join(f"{key}{value}" for key, value in layout.items())
    published = row["published_layout"]
    gpus = "its GPU count" if count == row["gpus"] else f"{count} GPUs, the row {row['gpus']}"
    note = (f"recipe {name} ({gpus}): "
            f"{recipe_layout}; published TP{published['tp']} PP{published['pp']} CP{published['cp']} "
            f"VP{published['virtual_stages_per_pipeline_rank']} EP{published['ep']} "
            f"MBS{published['micro_batch_size']} GBS{row['global_batch_size']}; the {row['release']} run used that "
            f"release's recipe, which 0.6.2 (built 2026-09-18: the 26.08 era) may not match")
    return {"function": name, "megatron_flags": [], "not_expressible": entries, "note": note,
            "layout": layout,
            "pipeline_split": split, "not_known": unknown, "no_megatron_flag": flagless}


def dispatcher_on(gpu: str, backend: str | None) -> bool:
    """Whether FLEX_FUNCTION keeps the flex dispatcher on this GPU of the set (all Blackwell, compute
    capability 10): HybridEP and NCCL EP on each, DeepEP only on GPUs named B200 or B300."""
    return backend in ("hybridep", "ncclep") or backend == "deepep" and gpu in ("b200", "b300")


def pipeline_split(row: dict, settings: dict, root: Path) -> dict:
    """The recipe's pipeline split as Megatron flags (SPLIT), and where each came from. A layout set by
    LAYOUT_FUNCTION is evaluated at the row's published PP and VP and the recipe's MTP depth (none where
    the table says "without MTP"); where the table prints no VP and the recipe sets the published PP,
    at the recipe's VP (the layout it sets at that PP). A layout placing MTP layers brings
    --mtp-num-layers, which Megatron requires beside it; a layout whose stages are not PP x VP of the
    published layout is not taken (the run's release must have split otherwise), said in `note`.
    `not_known` says where the recipe sets another PP or VP than the run's: the split (and what the
    recipe sets with it) is then not the release's as far as 0.6.2 knows (not_known_refusal)."""
    layout = row["published_layout"]
    pp, vp = layout["pp"], layout["virtual_stages_per_pipeline_rank"]
    recipe_pp = settings.get("model.pipeline_model_parallel_size", pp)
    recipe_vp = settings.get("model.virtual_pipeline_model_parallel_size") or 1
    flags, sources, notes = [], [], []
    vp_from_recipe = vp is None and pp > 1 and recipe_pp == pp and recipe_vp > 1
    vp = recipe_vp if vp_from_recipe else vp or 1
    mtp = 0 if "without MTP" in row["notes"] else settings.get(MTP) or 0
    for path, flag in SPLIT.items():
        value = settings.get(path)
        if isinstance(value, dict):
            value = layout_from_function(root, value["layout"], pp, vp, mtp)
            if value is None:
                notes.append(f"{LAYOUT_FUNCTION} has no layout for PP{pp} VP{vp}")
        if isinstance(value, list):
            value = "|".join("".join(LAYER_LETTERS[name] for name in stage) for stage in value)
        if value in (None, False):
            continue
        if path == "model.pipeline_model_parallel_layout":
            stages = len(re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), value).split("|"))
            if stages != pp * vp:
                notes.append(f"layout {value} has {stages} stages, the published PP{pp} x VP{vp} {pp * vp}: not taken")
                continue
        flags += [flag] if value is True else [flag, str(value)]
        sources.append(f"{path} = {value!r}")
        if path == "model.pipeline_model_parallel_layout" and "m" in value:
            flags += ["--mtp-num-layers", str(mtp)]
            sources.append(f"{MTP} = {mtp!r}" + (" (the row: without MTP)" if "without MTP" in row["notes"] else ""))
    if vp_from_recipe:
        if "--pipeline-model-parallel-layout" not in flags:
            flags += ["--num-virtual-stages-per-pipeline-rank", str(vp)]
        sources.append(f"model.virtual_pipeline_model_parallel_size = {vp!r} (the table prints no VP)")
    split = {"flags": flags, "source": "; ".join(sources), "note": "; ".join(notes)}
    if (recipe_pp, recipe_vp) != (pp, vp):
        split["not_known"] = (f"the recipe sets PP{recipe_pp} VP{recipe_vp}, the run PP{pp} VP{vp}: how the "
                              f"{row['release']} recipe split the pipeline there is not in 0.6.2")
    return split


def layout_from_function(root: Path, given: object, pp: int, vp: int, mtp_num_layers: object) -> object:
    """What LAYOUT_FUNCTION sets for a model config of this PP, VP and MTP depth: the wheel's own
    function (and its helpers) compiled from source alone, no imports, and run on a stand-in config."""
    source = root.parent / "recipes" / "deepseek" / "h100" / "deepseek_v3.py"
    wanted = {LAYOUT_FUNCTION, "_build_standalone_mtp_layout"}
    module = ast.Module([node for node in ast.parse(source.read_text()).body
                         if isinstance(node, ast.FunctionDef) and node.name in wanted], type_ignores=[])
    space = {"GPTModelProvider": object}
    exec(compile(module, str(source), "exec"), space)    # noqa: S102 (two pure functions of the wheel)
    model = SimpleNamespace(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                            mtp_num_layers=mtp_num_layers, pipeline_model_parallel_layout=None)
    space[LAYOUT_FUNCTION](model, given)
    return model.pipeline_model_parallel_layout


def recipe_functions(root: Path, folder: str, gpu: str) -> dict:
    """Every function of the shared helpers and of perf_recipes/<folder>/<gpu>/, by name; and, under
    ("base", name), each base recipe (a `*_config` function) they import from the wheel's recipes/."""
    files = [root / "_common.py", root / folder / "common.py", *sorted((root / folder / gpu).glob("*.py"))]
    trees = [ast.parse(f.read_text()) for f in files if f.exists()]
    functions = {node.name: node for tree in trees for node in tree.body if isinstance(node, ast.FunctionDef)}
    for tree in trees:
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.bridge.recipes"):
                for alias in node.names:
                    found = defined(root.parent.parent.parent, node.module, alias.name)
                    if found is not None and (alias.asname or alias.name).endswith("_config"):
                        functions[("base", alias.asname or alias.name)] = found
    return functions


def defined(wheel: Path, module: str, name: str) -> ast.FunctionDef | None:
    """The function `name` of a wheel module, following `from ... import a as name` re-exports."""
    source = wheel.joinpath(*module.split(".")).with_suffix(".py")
    if not source.exists():
        return None
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.bridge"):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return defined(wheel, node.module, alias.name)
    return None


CFG = object()
"""The config a recipe builds, as a bound value while interpreting."""


def interpret(functions: dict, name: str, bound: dict, settings: dict, unknown: list) -> None:
    """Run a recipe function's straight-line assignments to `cfg.<section>.<field>` into `settings`
    (later wins); calls to recipe helpers are followed with their arguments bound; anything else
    (base recipes, conditionals, other calls) is recorded in `unknown`."""
    fn = functions[name]
    params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
    defaults = fn.args.defaults + fn.args.kw_defaults
    env = {p: ast.literal_eval(d) for p, d in zip(params[len(params) - len(defaults):], defaults) if d is not None}
    env.update(bound)
    for stmt in fn.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) or isinstance(stmt, ast.Return):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            call(functions, stmt.value, env, settings, unknown)
        elif isinstance(stmt, ast.Assign):
            value = value_of(functions, stmt.value, env, settings, unknown)
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    env[target.id] = value
                elif (path := cfg_path(target, env)) is not None:
                    assign(path, value, settings)
        else:
            unknown.append(f"{name} line {stmt.lineno}: {ast.unparse(stmt).splitlines()[0]} (not read)")


def call(functions: dict, node: ast.Call, env: dict, settings: dict, unknown: list) -> object:
    """A call in a recipe: a recipe helper is interpreted; another (a base recipe) is recorded."""
    name = node.func.id if isinstance(node.func, ast.Name) else None
    if name == LAYOUT_FUNCTION:
        given = node.args[1] if len(node.args) > 1 else None
        settings.pop("model.pipeline_model_parallel_layout", None)
        settings["model.pipeline_model_parallel_layout"] = {"layout": given and ast.literal_eval(given)}
        return None
    if name == FLEX_FUNCTION:        # its backend argument is the config's (cfg.model.moe_flex_dispatcher_backend)
        given = node.args[1] if len(node.args) > 1 else None
        path = given and cfg_path(given, env)
        backend = settings.get(path) if path else given and ast.literal_eval(given)
        settings.pop(DISPATCHER[0], None)
        settings[DISPATCHER[0]] = {"flex": backend}
        return None
    if ("base", name) in functions:
        base = {}
        interpret({**functions, name: functions[("base", name)]}, name, {}, base, [])
        for path in (*SPLIT, MTP, *DISPATCHER):
            if path in base:
                settings.pop(path, None)
                settings[path] = base[path]
        read = ", ".join(f"{p} = {base[p]!r}" for p in (*SPLIT, MTP, *DISPATCHER) if p in base)
        unknown.append(f"{name}(): base recipe {functions[('base', name)].name}, only its pipeline split and "
                       f"token dispatcher read ({read or 'none set'})")
        return CFG
    if name not in functions:
        passed_cfg = any(cfg_path(a, env) is not None for a in node.args)
        if name not in ("getattr", "hasattr", "isinstance") and (passed_cfg or str(name).endswith("_config")
                                                                 or name == "_pretrain_common"):
            unknown.append(f"{ast.unparse(node)}: outside perf_recipes, its settings not read")
            return CFG
        return ast.unparse(node)        # a local computation (getattr, ...), read by no assignment here
    fn = functions[name]
    params = [a.arg for a in fn.args.args]
    bound = {p: value_of(functions, a, env, settings, unknown) for p, a in zip(params, node.args)}
    bound.update({k.arg: value_of(functions, k.value, env, settings, unknown) for k in node.keywords})
    interpret(functions, name, bound, settings, unknown)
    return CFG


def value_of(functions: dict, node: ast.expr, env: dict, settings: dict, unknown: list) -> object:
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id == "_perf_precision":
            dtype = ast.literal_eval(node.args[0])
            settings.update(MIXED_PRECISION[PRECISION_SUFFIX[dtype]])
            return ("precision", dtype)
        if node.func.id == "CommOverlapConfig":
            for k in node.keywords:
                assign(f"comm_overlap.{k.arg}", value_of(functions, k.value, env, settings, unknown), settings)
            return ("CommOverlapConfig",)
        return call(functions, node, env, settings, unknown)
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def cfg_path(node: ast.expr, env: dict) -> str | None:
    """`cfg.model.x` as "model.x", where `cfg` is bound to the config."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and env.get(node.id) is CFG:
        return ".".join(reversed(parts))
    return None


def assign(path: str, value: object, settings: dict) -> None:
    if not isinstance(value, tuple):       # the precision and comm-overlap objects are read by value_of
        settings.pop(path, None)
        settings[path] = value


def megatron_words(path: str, value: object) -> list[str] | None:
    """The Megatron words that set `path` to `value` ([] where it is Megatron's default), or None where
    the setting names no Megatron 0.19.2 argument (or its value could not be read)."""
    table = flag_table()
    if path in ("ddp.grad_reduce_in_fp32", "mixed_precision.grad_reduce_in_fp32"):
        name, value = "grad_reduce_in_bf16", not value
    else:
        name = ARGUMENT.get(path, path.split(".")[-1])
    if name not in table.options:
        return None
    option = table.flag(name)
    if isinstance(value, bool):
        default_on = option.startswith(("--no-", "--disable-", "--untie-"))
        return [option] if value != default_on else []
    if value is None or value == []:
        return []
    if isinstance(value, str) and value.startswith("torch."):
        value = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float16": "fp16"}.get(value)
    if isinstance(value, str) and not re.fullmatch(r"[\w.\-]+", value):
        return None
    return [option, *(str(v) for v in value)] if isinstance(value, list) else [option, str(value)]


if __name__ == "__main__":
    sys.exit(main())
