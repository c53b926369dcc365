"""benchmarks.validation.release_steps: a row's error is set apart only where the same inputs were
measured far apart by releases."""

import json

from benchmarks.validation import published_runs_blackwell as blackwell
from benchmarks.validation.release_steps import ANOTHER_RECIPE, RELEASE_STEP, STEP_ELSEWHERE, explanations, inputs

ROWS = {row["id"]: row for row in json.loads(blackwell.DATA.read_text())["rows"]}
BEFORE, AFTER = ROWS["bw26.04.01-gb200-qwen3-30b-a3b-MXFP8"], ROWS["bw26.06-gb200-qwen3-30b-a3b-MXFP8"]


def priced(*errors: float, fits: bool = True) -> list[dict]:
    return [{"recipe": {"error": e, "fits": fits}} for e in errors]


def explained(rows: list[dict], *errors: float) -> list[tuple[str, str] | None]:
    return explanations(rows, [blackwell.as_h100_row(row) for row in rows], priced(*errors))


def test_one_layout_measured_26k_then_41k_explains_the_later_rows_error():
    assert inputs(blackwell.as_h100_row(BEFORE)) == inputs(blackwell.as_h100_row(AFTER))
    why = explained([BEFORE, AFTER], -0.09, 0.42)
    assert why[0] is None                               # within the bar: nothing to explain
    assert why[1][0] == RELEASE_STEP and "26,112 tokens/s/GPU in 26.04.01 and 40,706 in 26.06" in why[1][1]


def test_a_row_alone_at_its_inputs_and_its_recipes_layout_stays_unexplained():
    other = ROWS["bw26.06-gb300-deepseekv3-MXFP8"]      # 0.6.2's recipe sets its layout (MBS 1)
    assert explained([other, AFTER], 0.5, 0.1) == [None, None]


def test_rows_measured_alike_explain_nothing():
    same = {**AFTER, "release": "26.06.01", "tokens_per_s_per_gpu": 40_960}
    assert explained([AFTER, same], 0.42, 0.43) == [None, None]


def test_a_run_at_another_layout_than_its_recipes_has_settings_not_known():
    """26.02 ran Qwen3-30B-A3B on B200 at micro-batch 1; 0.6.2's recipe for it sets 4."""
    row = ROWS["bw26.02-b200-qwen3-30b-a3b-MXFP8"]
    kind, why = explained([row], -0.37)[0]
    assert kind == ANOTHER_RECIPE and "the run's MBS 1 where 0.6.2's recipe has MBS 4" in why


def test_a_layout_predicted_not_to_fit_is_explained_by_another_recipe_never_by_a_release_step():
    """26.04 ran DeepSeek-V3 on 256 GB300 at micro-batch 2; 0.6.2's recipe sets 1. A release step says
    nothing of memory: the 26k-then-41k row within the bar but predicted not to fit stays unexplained."""
    mbs2 = ROWS["bw26.04-gb300-deepseekv3-MXFP8"]
    kind, why = explanations([mbs2], [blackwell.as_h100_row(mbs2)], priced(-0.05, fits=False))[0]
    assert kind == ANOTHER_RECIPE and "the run's MBS 2 where 0.6.2's recipe has MBS 1" in why
    rows = [BEFORE, AFTER]
    assert explanations(rows, [blackwell.as_h100_row(r) for r in rows], priced(-0.09, 0.1, fits=False)) == [None, None]


def test_a_step_of_the_same_run_on_another_system_explains_a_row_its_system_did_not_run_again():
    """B200 ran Qwen3-30B-A3B at GB200's layout in 26.04 at GB200's speed (26.9k, 26.0k tokens/s/GPU);
    GB200 ran it again in 26.08 at 39.9k, B200 did not: the B200 row priced 30% too fast is explained by
    GB200's step, not where B200 itself re-ran it that late, nor an error of the other sign."""
    b200, gb200, later = (ROWS[f"bw{r}-{s}-qwen3-30b-a3b-MXFP8"] for r, s in
                          (("26.04", "b200"), ("26.04", "gb200"), ("26.08", "gb200")))
    kind, why = explained([b200, gb200, later], -0.30, 0.0, 0.0)[0]
    assert kind == STEP_ELSEWHERE and "DGX-GB200 measured 26,032 tokens/s/GPU in 26.04 and 39,936 in 26.08" in why
    assert explained([b200, gb200, later], 0.30, 0.0, 0.0)[0] is None
    rerun = {**b200, "id": "b200-again", "release": "26.08"}
    assert explained([b200, gb200, later, rerun], -0.30, 0.0, 0.0, -0.30)[0] is None
