"""benchmarks.validation.release_steps: a row's error is set apart only where the same inputs were
measured far apart by releases."""

import json

from benchmarks.validation import published_runs_blackwell as blackwell
from benchmarks.validation.release_steps import inputs, release_spread

ROWS = {row["id"]: blackwell.as_h100_row(row) for row in json.loads(blackwell.DATA.read_text())["rows"]}
BEFORE, AFTER = ROWS["bw26.04.01-gb200-qwen3-30b-a3b-MXFP8"], ROWS["bw26.06-gb200-qwen3-30b-a3b-MXFP8"]


def priced(*errors: float) -> list[dict]:
    return [{"recipe": {"error": e}} for e in errors]


def test_one_layout_measured_26k_then_41k_explains_the_later_rows_error():
    assert inputs(BEFORE) == inputs(AFTER)
    why = release_spread([BEFORE, AFTER], priced(-0.09, 0.42))
    assert why[0] is None                               # within the bar: nothing to explain
    assert "26,112 tokens/s/GPU in 26.04.01 and 40,706 in 26.06" in why[1]


def test_a_row_alone_at_its_inputs_stays_unexplained():
    other = ROWS["bw26.06-gb300-deepseekv3-MXFP8"]
    assert release_spread([other, AFTER], priced(0.5, 0.42)) == [None, None]


def test_rows_measured_alike_explain_nothing():
    same = {**AFTER, "release": "26.06.01", "tokens_per_s_per_gpu": 40_960}
    assert release_spread([AFTER, same], priced(0.42, 0.43)) == [None, None]
