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
    """A perf recipe starting from a base recipe takes the base's split (and MTP depth), not its other
    settings, and the split follows the base's re-export to where it is defined."""
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
    for name, text in files.items():
        (wheel / name).parent.mkdir(parents=True, exist_ok=True)
        (wheel / name).write_text(text)
    functions = blackwell.recipe_functions(wheel / "perf_recipes", "llama", "b200")
    settings, unknown = {}, []
    blackwell.interpret(functions, "llama31_405b_pretrain_64gpu_b200_bf16_config", {}, settings, unknown)
    assert settings == {"model.account_for_embedding_in_pipeline_split": True,
                        "model.account_for_loss_in_pipeline_split": True, "model.pipeline_model_parallel_size": 8}
    assert "base recipe base_256gpu_config, only its pipeline split read" in unknown[0]
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
