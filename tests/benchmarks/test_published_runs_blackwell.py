"""benchmarks/published_runs_blackwell.py prices the Blackwell rows it can and refuses the rest by the
setting's name (issue 31's baseline): one priced row, and rows once refused for MXFP8, GB300, NVFP4 and VP
as the recipes write them, now refused only for what the planner still cannot price."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import published_runs_blackwell as blackwell  # noqa: E402
from published_runs_h100 import recipe_flags  # noqa: E402

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
    out = blackwell.priced_row(ROWS["bw26.08-gb300-deepseekv3-MXFP8"], search=False)
    assert "error" not in out["recipe"]
    assert "--cluster gb300-nvl72" not in {blackwell.reason(m) for m in out["refused"]}
    # 61 layers over PP 2 in 8 chunks a rank: Megatron's own rule, no longer VP's spelling
    assert "--num-virtual-stages-per-pipeline-rank 8 must divide the layers of every pipeline stage" in \
        " ".join(out["refused"])
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
