"""Megatron's list expressions and layout repeats are read within bounds: any text ends at once in a
value or a PipetteError naming the flag (Python's eval, which Megatron uses, hangs on [1]*9**9**9)."""

import sys

import pytest

from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.expressions import list_expression
from megatron_pipette.spec.layout import parse_pipeline_layout
from megatron_pipette.spec.workload import Workload

VALID = ["([0]+[1]*23)", "[1,0]*12", "([1]*3+[0]*1)*6", "[0]*2+[1]*(20+2)", "[1]*2**3*3", "[0,1,1,0]*(2*3)",
         " ( [0] + [1] * 23 ) ", "[1]*0+[0]*24", "[0]+[1]*23+[]"]


@pytest.mark.parametrize("text", VALID)
def test_the_forms_megatron_evaluates_give_eval_s_list(text):
    assert list_expression(text, max_length=24, flag="--moe-layer-freq") == eval(text)  # noqa: S307


@pytest.mark.parametrize("text, reason", [
    ("[1]*9**9**9", "an integer above"),
    ("[1]*10**20", "an integer above"),
    ("[][0]", "only integers, lists of integers"),
    ("[1]*25", "a list of 25 entries, more than the 24 expected"),
    ("([1]*13)*2", "a list of 26 entries"),
    ("[0]*1048576+[1]", "a list of 1048576 entries"),
    ("[[1]]*24", "a list of lists"),
    ("[1]*-1", "only integers"),
    ("[1]*2**-1", "only integers"),
    ("[1]*(2**65)", "2**65 is not an integer up to"),
    ("__import__('os').system('true')", "only integers"),
    ("[1.0]*24", "only integers"),
    ("[1]+2", "+ joins two lists"),
    ("[1]*[2]", "* repeats a list"),
    ("[1]*" + "9" * 5000, "characters is longer than 4096"),
    ("(" * 300 + "[1]" + ")" * 300, "not a list expression"),
    ("[1]+" * 1000 + "[1]", "nested more than 256 deep"),
    ("(1,2)", "only integers"),
    ("3", "not a list expression"),
    ("[1", "not a list expression"),
])
def test_anything_else_is_one_error_naming_the_flag(text, reason):
    with pytest.raises(PipetteError, match=r"^--moe-layer-freq") as e:
        list_expression(text, max_length=24, flag="--moe-layer-freq")
    assert reason in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 300


@pytest.mark.parametrize("limit", [1000, 100_000])
def test_the_answer_does_not_depend_on_the_recursion_limit(limit):
    """A chain of 1,001 lists: refused for its depth whatever limit earlier tests or imports left
    behind (it once read "not a list expression" alone and "a list of 25 entries" in the suite)."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        with pytest.raises(PipetteError, match="nested more than 256 deep"):
            list_expression("[1]+" * 1000 + "[1]", max_length=24, flag="--moe-layer-freq")
        assert list_expression("[0]+" * 200 + "[1]", max_length=256, flag="--moe-layer-freq")[-2:] == [0, 1]
    finally:
        sys.setrecursionlimit(before)


@pytest.mark.parametrize("freq", ["[1]*9**9**9", "[][0]", "[1]*10**20", "9" * 5000, "0", "-2", "[2]*4", 0, -1])
def test_a_workload_refuses_a_bad_moe_layer_freq(freq):
    with pytest.raises(PipetteError, match="^--moe-layer-freq"):
        Workload(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, global_batch_size=8,
                 num_experts=4, swiglu=True, add_bias_linear=False, moe_layer_freq=freq)


@pytest.mark.parametrize("freq, pattern", [(2, (1, 0, 1, 0)), ("2", (1, 0, 1, 0)), ("([0]+[1]*3)", (0, 1, 1, 1)),
                                           ("[1, 0, 1, 0]", (1, 0, 1, 0))])
def test_a_workload_reads_megatron_s_forms(freq, pattern):
    w = Workload(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, global_batch_size=8,
                 num_experts=4, swiglu=True, add_bias_linear=False, moe_layer_freq=freq)
    assert w.moe_layer_pattern() == tuple(map(bool, pattern))


@pytest.mark.parametrize("text, reason", [
    ("t*99999999999", "its repeats spell more than 65536 letters"),
    ("E(t|)*9999999999999999999999L", "its repeats spell more than"),
    ("E" + "(t*60000)*2|" * 3 + "L", "its repeats spell more than"),
    ("E" + "t" * 5000 + "L", "more than 4096"),
])
def test_layout_repeats_are_bounded(text, reason):
    with pytest.raises(PipetteError, match="^--pipeline-model-parallel-layout") as e:
        parse_pipeline_layout(text)
    assert reason in str(e.value)


def test_layout_repeats_within_bounds_unroll_as_megatron_does():
    assert parse_pipeline_layout("Et*3|(t*4|)*2t*3L") == ["Ettt", "tttt", "tttt", "tttL"]
    assert len("".join(parse_pipeline_layout("E|t*65000|L"))) == 65002
