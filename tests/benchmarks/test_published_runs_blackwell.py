"""benchmarks/validation/published_runs_blackwell.py prices the Blackwell rows it can and refuses the rest by the
setting's name (issue 31's baseline): one priced row, and rows once refused for MXFP8, GB300, NVFP4 and VP
as the recipes write them, now refused only for what the planner still cannot price."""

import json
from pathlib import Path

from benchmarks.validation import published_runs_blackwell as blackwell
from benchmarks.validation.published_runs_h100 import recipe_flags

ROOT = Path(__file__).resolve().parents[2]

ROWS = {row["id"]: row for row in json.loads(blackwell.DATA.read_text())["rows"]}


def test_a_bf16_fp8_row_on_b200_is_priced_against_its_published_throughput():
    row = ROWS["bw25.09-b200-llama3-8b-na"]
    out = blackwell.priced_row(row, search=False)
    recipe = out["recipe"]
    assert recipe["fits"] and out["refused"] == []
    assert recipe["error"] == recipe["predicted_s"] / row["iteration_time_s"] - 1
    assert recipe["predicted_tokens_per_s_per_gpu"] == blackwell.tokens_per_gpu(row, recipe["predicted_s"])
    assert out["recipe_function"] == "llama3_8b_pretrain_8gpu_b200_fp8cs_config"


def test_refused_rows_name_every_setting_the_planner_cannot_price():
    out = blackwell.priced_row(ROWS["bw25.11-gb300-deepseekv3-w-o-mtp-FP8-MX"], search=False)
    assert "error" not in out["recipe"]
    assert "--cluster gb300-nvl72" not in {blackwell.reason(m) for m in out["refused"]}
    # 61 layers over PP 2 in 4 chunks a rank: the 0.6.2 recipe's layout has 16 stages (PP 2 x VP 8), not 8,
    # so not taken; Megatron refuses the split as read too, so the row's settings are not known
    assert "--num-virtual-stages-per-pipeline-rank 4 must divide the layers of every pipeline stage" in \
        " ".join(out["refused"])
    assert out["not_known"].startswith("the recipe sets PP2 VP8, the run PP2 VP4")
    nvfp4 = next(r for r in ROWS.values() if r["precision"] == "nvfp4" and r["cluster"] == "gb200-nvl72")
    assert "--fp4-format" not in {blackwell.reason(m) for m in blackwell.priced_row(nvfp4, search=False)["refused"]}


def test_refusals_are_counted_by_first_and_by_every_reason():
    rows = [{"recipe": {"error_message": "--fp8-recipe must be one of delayed, tensorwise, got 'mxfp8'"},
             "refused": ["--fp8-recipe must be one of delayed, tensorwise, got 'mxfp8'",
                         "--cluster 'gb300-nvl72' is neither a preset (...) nor a file"]},
            {"recipe": {"error": 0.1}, "refused": []}]
    assert blackwell.refusal_counts(rows) == {"by_first_reason": {"--fp8-recipe mxfp8": 1},
                                              "by_every_reason": {"--fp8-recipe mxfp8": 1,
                                                                  "--cluster gb300-nvl72": 1}}


def test_mxfp8_parameter_gather_and_its_buffer_reuse_are_priced_together():
    """The recipes set --fp8-param-gather and --reuse-grad-buf-for-mxfp8-param-ag together; the planner
    refuses either alone under MXFP8, so the row takes both as one setting."""
    row = blackwell.as_h100_row(ROWS["bw26.04.01-gb300-llama3-70b-MXFP8"])
    flags, left = recipe_flags(row)
    assert {"--fp8-param-gather", "--reuse-grad-buf-for-mxfp8-param-ag"} <= set(flags)
    assert not any("param-gather" in entry or "reuse-grad-buf" in entry for entry in left)


def test_the_recipes_pipeline_split_prices_the_vp_rows_it_once_refused():
    """Llama 3.1 405B's 126 layers split over PP 8 in 4 chunks only with the embedding and loss counted
    (its base recipe's account_for_*_in_pipeline_split); DeepSeek-V3's 61 over PP 4 x VP 4 only with the
    layout set_deepseek_v3_pipeline_model_parallel_layout gives, its MTP layer with it."""
    llama = ROWS["bw26.06-gb300-llama3.1-405b-MXFP8"]
    assert blackwell.launch(llama)["split"] == ["--num-virtual-stages-per-pipeline-rank", "4",
                                                "--account-for-embedding-in-pipeline-split",
                                                "--account-for-loss-in-pipeline-split"]
    deepseek = ROWS["bw26.06-gb200-deepseekv3-MXFP8"]
    split = blackwell.launch(deepseek)["split"]
    assert split[0] == "--pipeline-model-parallel-layout" and len(split[1].split("|")) == 16
    assert split[2:] == ["--mtp-num-layers", "1"]
    for row in (llama, deepseek):
        out = blackwell.priced_row(row, search=False)
        assert "error" in out["recipe"] and out["refused"] == []
    without = blackwell.launch(ROWS["bw25.11-gb200-deepseekv3-w-o-mtp-BF16"])["split"]
    assert "m" not in without[1] and "--mtp-num-layers" not in without


def test_the_resolver_reads_only_the_split_from_the_base_recipe(tmp_path):
    """A perf recipe starting from a base recipe takes the base's split (and MTP depth) and token
    dispatcher, not its other settings, and the split follows the base's re-export to where it is defined."""
    wheel = tmp_path / "megatron" / "bridge"
    files = {
        "perf_recipes/_common.py": "",
        "perf_recipes/llama/common.py": ("from megatron.bridge.recipes.llama.llama3 import "
                                         "llama31_405b_pretrain_config\n"),
        "perf_recipes/llama/b200/llama31.py": (
            "def llama31_405b_pretrain_64gpu_b200_bf16_config():\n"
            "    cfg = llama31_405b_pretrain_config()\n"
            "    cfg.model.pipeline_model_parallel_size = 8\n"),
        "recipes/llama/llama3.py": "from megatron.bridge.recipes.llama.h100.llama3 import (\n"
                                   "    base_256gpu_config as llama31_405b_pretrain_config,\n)\n",
        "recipes/llama/h100/llama3.py": (
            "def base_256gpu_config():\n"
            "    cfg = _pretrain_common()\n"
            "    cfg.model.recompute_granularity = 'full'\n"
            "    cfg.model.account_for_embedding_in_pipeline_split = True\n"
            "    cfg.model.account_for_loss_in_pipeline_split = True\n"
            "    return cfg\n")}
    write_wheel(wheel, files)
    functions = blackwell.recipe_functions(wheel / "perf_recipes", "llama", "b200")
    settings, unknown = {}, []
    blackwell.interpret(functions, "llama31_405b_pretrain_64gpu_b200_bf16_config", {}, settings, unknown)
    assert settings == {"model.account_for_embedding_in_pipeline_split": True,
                        "model.account_for_loss_in_pipeline_split": True, "model.pipeline_model_parallel_size": 8}
    assert "base recipe base_256gpu_config, only its pipeline split and token dispatcher read" in unknown[0]
    row = ROWS["bw26.06-gb200-llama3.1-405b-MXFP8"]
    assert blackwell.pipeline_split(row, settings, wheel / "perf_recipes")["flags"] == [
        "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]


def test_a_row_without_a_printed_vp_takes_the_vp_its_recipe_sets_at_the_same_pp():
    """The B300 table prints no VP for DeepSeek-V3 at PP 8; the 0.6.2 recipe sets PP 8 VP 2 (with
    --overlap-moe-expert-parallel-comm, which Megatron allows at PP > 1 only interleaved), so the layout is
    set_deepseek_v3_pipeline_model_parallel_layout's at (8, 2): 16 stages, and the row is priced."""
    row = ROWS["bw26.06-b300-deepseekv3-MXFP8"]
    split = row["recipe"]["pipeline_split"]
    assert len(split["flags"][1].split("|")) == 16 and "not_known" not in split
    out = blackwell.priced_row(row, search=False)
    assert "error" in out["recipe"] and out["not_known"] is None
    assert "--overlap-moe-expert-parallel-comm" in out["recipe_flags"]


def test_a_row_whose_recipe_splits_another_pp_and_megatron_refuses_as_read_is_not_known():
    """B300 at PP 16: the 0.6.2 recipe sets PP 8 VP 2 with the expert-parallel overlap; read at PP 16 with
    no VP, Megatron refuses the overlap too, so the release's settings are not known (not a refusal)."""
    row = ROWS["bw26.02-b300-deepseekv3-MXFP8"]
    out = blackwell.priced_row(row, search=False)
    assert out["not_known"].startswith("the recipe sets PP8 VP2, the run PP16 VP1")
    assert "--overlap-moe-expert-parallel-comm" in out["not_known"]
    assert blackwell.refusal_counts([out]) == {"by_first_reason": {}, "by_every_reason": {}}
    assert blackwell.not_known(row, "--use-megatron-fsdp: fully sharded data parallelism (FSDP) is not modelled") \
        is None


def write_wheel(wheel: Path, files: dict[str, str]) -> None:
    """A stand-in megatron-bridge wheel: each file's source under `wheel`."""
    for name, text in files.items():
        (wheel / name).parent.mkdir(parents=True, exist_ok=True)
        (wheel / name).write_text(text)


def deepseek_wheel(tmp_path, backend: str):
    """A wheel whose B200 and GB200 DeepSeek-V3 perf recipes set no dispatcher and whose base recipe ends
    as Megatron-Bridge 0.6.2's does: alltoall, a flex backend, then apply_flex_dispatcher_backend."""
    wheel = tmp_path / "megatron" / "bridge"
    perf = ("from megatron.bridge.perf_recipes.deepseek.common import deepseek_v3_pretrain_config\n"
            "def deepseek_v3_pretrain_256gpu_{gpu}_fp8mx_config():\n"
            "    cfg = deepseek_v3_pretrain_config()\n"
            "    cfg.model.expert_model_parallel_size = 32\n")
    files = {
        "perf_recipes/_common.py": "",
        "perf_recipes/deepseek/common.py": ("from megatron.bridge.recipes.deepseek.deepseek_v3 import "
                                            "deepseek_v3_pretrain_config\n"),
        "perf_recipes/deepseek/b200/deepseek_v3.py": perf.format(gpu="b200"),
        "perf_recipes/deepseek/gb200/deepseek_v3.py": perf.format(gpu="gb200"),
        "recipes/deepseek/deepseek_v3.py": (
            "def deepseek_v3_pretrain_config():\n"
            "    cfg = _pretrain_common()\n"
            "    cfg.model.moe_token_dispatcher_type = 'alltoall'\n"
            f"    cfg.model.moe_flex_dispatcher_backend = {backend!r}\n"
            "    cfg.model.moe_shared_expert_overlap = True\n"
            "    apply_flex_dispatcher_backend(cfg.model, cfg.model.moe_flex_dispatcher_backend)\n"
            "    return cfg\n")}
    write_wheel(wheel, files)
    return wheel / "perf_recipes"


def dispatcher_entries(recipe: dict) -> list[str]:
    return [entry.split(":")[0] for entry in recipe["not_expressible"] if "dispatcher" in entry or "groups" in entry]


def test_the_base_recipes_flex_dispatcher_is_read_as_bridge_applies_it_on_the_rows_gpu(tmp_path):
    """The B200 DeepSeek-V3 perf recipes set no dispatcher: they run their base recipe's, which
    apply_flex_dispatcher_backend makes HybridEP on every Blackwell GPU, DeepEP only on B200/B300
    (Megatron-Bridge 0.6.2, training/flex_dispatcher_backend.py), else alltoall; DeepSeek-V3's
    node-limited routing comes with the model."""
    row = {**ROWS["bw26.04.01-b200-deepseekv3-MXFP8"], "recipe": None}
    gb200 = {**row, "system": "GB200", "label": "26.04.01 DeepSeekV3 GB200"}
    hybrid = deepseek_wheel(tmp_path / "hybridep", "hybridep")
    routing = "--moe-router-num-groups 8 --moe-router-group-topk 4"
    for on in (row, gb200):
        assert dispatcher_entries(blackwell.resolve_recipe(on, hybrid)) == [
            "--moe-token-dispatcher-type flex", "--moe-flex-dispatcher-backend hybridep", routing]
    deepep = deepseek_wheel(tmp_path / "deepep", "deepep")
    assert dispatcher_entries(blackwell.resolve_recipe(row, deepep))[:2] == [
        "--moe-token-dispatcher-type flex", "--moe-flex-dispatcher-backend deepep"]
    assert dispatcher_entries(blackwell.resolve_recipe(gb200, deepep)) == [
        "--moe-token-dispatcher-type alltoall", routing]


def test_deepseek_v3_over_b200_nodes_is_priced_with_hybridep_and_node_limited_routing():
    """EP 32 over four DGX-B200 nodes: HybridEP sends a token once per remote node holding one of its
    experts, and node-limited routing bounds those at 4 of the 8 groups (2 a node): its dispatch is
    priced at under half an NCCL all-to-all's (33.7 s of the step before the set read the base recipe)."""
    row = ROWS["bw26.04.01-b200-deepseekv3-MXFP8"]
    flags, _ = recipe_flags(blackwell.as_h100_row(row))
    words = " ".join(flags)
    assert "--moe-token-dispatcher-type flex" in words and "--moe-flex-dispatcher-backend hybridep" in words
    assert "--moe-router-num-groups 8 --moe-router-group-topk 4" in words
    recipe = blackwell.priced_row(row, search=False)["recipe"]
    assert recipe["breakdown_s"]["ep_comm_s"] < 0.5 * 33.7


def test_selective_recomputation_of_no_module_is_read_as_none(tmp_path):
    """The GB300 DeepSeek-V3 MXFP8 recipe keeps the common "selective" and sets recompute_modules = []:
    TransformerConfig then recomputes nothing (it fills in core_attn only for None), so the launch has no
    --recompute-granularity; a recipe naming modules keeps both."""
    perf = ("def deepseek_v3_pretrain_256gpu_gb300_fp8mx_config():\n"
            "    cfg = _pretrain_common()\n"
            "    cfg.model.recompute_granularity = 'selective'\n"
            "    cfg.model.recompute_modules = {modules}\n")
    row = {**ROWS["bw26.06-gb300-deepseekv3-MXFP8"], "recipe": None}
    entries = {}
    for modules in ([], ["mla_up_proj"]):
        wheel = tmp_path / str(len(modules)) / "megatron" / "bridge"
        write_wheel(wheel, {"perf_recipes/_common.py": "",
                            "perf_recipes/deepseek/gb300/deepseek_v3.py": perf.format(modules=modules)})
        recipe = blackwell.resolve_recipe(row, wheel / "perf_recipes")
        entries[len(modules)] = [e.split(":")[0] for e in recipe["not_expressible"] if "recompute" in e]
    assert entries == {0: [], 1: ["--recompute-granularity selective", "--recompute-modules mla_up_proj"]}
