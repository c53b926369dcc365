"""The in-job options and the variables beside them (integration.options) and the layout flags typed
beside --auto-parallel: a bad value is one line naming the flag or the variable, never a silently
different job nor a traceback on every rank (issue 33)."""

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_pipette.errors import PipetteError
from megatron_pipette.integration.options import (
    DEFAULT_CACHE_DIR,
    add_auto_parallel_args,
    cache_dir,
    check_options,
    requested,
)
from megatron_pipette.integration.plan_check import JobRequest, typed_problem
from megatron_pipette.spec.workload import workload_from_preset

WORKER = Path(__file__).with_name("autoparallel_worker.py")
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "16",
        "--vocab-size", "1024", "--tokenizer-type", "NullTokenizer", "--train-iters", "10",
        "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
        "--distributed-backend", "gloo", "--lr", "1e-3", "--mock-data"]


def parse(argv: list[str]) -> argparse.Namespace:
    return add_auto_parallel_args(argparse.ArgumentParser()).parse_args(argv)


@pytest.mark.parametrize("argv, message", [
    *((["--auto-parallel-budget-s", value], "argument --auto-parallel-budget-s: must be a number of seconds above 0 "
                                            "and at most 86400")
      for value in ("nan", "-5", "0", "1e308", "inf", "soon")),
    (["--auto-parallel-cache-dir", ""], "argument --auto-parallel-cache-dir: must name a file or directory, got ''"),
    (["--auto-parallel-plan-file", " "], "argument --auto-parallel-plan-file: must name a file or directory"),
])
def test_a_bad_value_of_an_option_is_one_error_naming_it(argv: list[str], message: str, capsys) -> None:
    """A budget of nan, -5 or 1e308 was taken (the dry run exited 0), and an empty cache directory made
    the working directory the cache."""
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err


def test_the_budget_takes_seconds_up_to_a_day() -> None:
    assert parse([]).auto_parallel_budget_s == 120.0
    assert parse(["--auto-parallel-budget-s", "86400"]).auto_parallel_budget_s == 86400.0


@pytest.mark.parametrize("value, on", [("1", True), ("yes", True), ("TRUE", True), (" on ", True),
                                       ("0", False), ("no", False), ("False", False), ("off", False), ("", False)])
def test_the_switch_variable_takes_the_usual_spellings(value: str, on: bool, monkeypatch) -> None:
    """PIPETTE_AUTO_PARALLEL=yes was silently off."""
    monkeypatch.setenv("PIPETTE_AUTO_PARALLEL", value)
    monkeypatch.delenv("PIPETTE_CPU_REHEARSAL", raising=False)
    monkeypatch.delenv("PIPETTE_CACHE_DIR", raising=False)
    assert requested([]) is on and parse([]).auto_parallel is on
    check_options(parse([]))


@pytest.mark.parametrize("name", ["PIPETTE_AUTO_PARALLEL", "PIPETTE_CPU_REHEARSAL"])
def test_another_word_in_a_switch_variable_is_refused_in_one_line(name: str, monkeypatch) -> None:
    """Neither on nor off: the hook runs (so that it can say so) and refuses it, naming the variable."""
    monkeypatch.setenv(name, "maybe")
    monkeypatch.delenv("PIPETTE_CACHE_DIR", raising=False)
    if name == "PIPETTE_AUTO_PARALLEL":
        assert requested([]) and parse([]).auto_parallel
    with pytest.raises(PipetteError) as error:
        check_options(parse([]))
    assert str(error.value).startswith(f"{name}='maybe': must be one of 1, on, true, yes (on)")


def test_the_cache_directory_and_what_chose_it(tmp_path: Path, monkeypatch) -> None:
    """An empty PIPETTE_CACHE_DIR made the working directory the cache: refused, naming the variable;
    the messages about the cache name whichever of the flag and the variable chose it."""
    monkeypatch.delenv("PIPETTE_CACHE_DIR", raising=False)
    assert cache_dir(parse([])) == (DEFAULT_CACHE_DIR, "--auto-parallel-cache-dir")
    monkeypatch.setenv("PIPETTE_CACHE_DIR", str(tmp_path))
    assert cache_dir(parse([])) == (tmp_path, "PIPETTE_CACHE_DIR")
    assert cache_dir(parse(["--auto-parallel-cache-dir", "c"])) == (Path("c"), "--auto-parallel-cache-dir")
    monkeypatch.setenv("PIPETTE_CACHE_DIR", "")
    with pytest.raises(PipetteError, match=r"^PIPETTE_CACHE_DIR='': empty, which would make the working directory "
                                           r"the cache"):
        check_options(parse([]))
    check_options(parse(["--auto-parallel-cache-dir", str(tmp_path)]))     # the flag chooses: not used


def test_a_typed_size_no_layout_honours_is_named_before_anything_is_probed() -> None:
    """--tensor-model-parallel-size 3 beside --auto-parallel on 4 processes: the search's own rules say
    why in one line (the hook stops with it on every rank, UnrunnableFlags, before probing)."""
    request = JobRequest(workload=workload_from_preset("tiny-gpt"), world_size=4, gpus_per_node=4,
                         typed={"tensor_model_parallel_size": 3})
    assert typed_problem(request) == ("no layout of this model on 4 processes honours the layout flags fixed here "
                                      "(--tensor-model-parallel-size 3): --tensor-model-parallel-size 3 does not "
                                      "divide the 4 GPUs")
    assert typed_problem(replace(request, typed={"tensor_model_parallel_size": 2})) is None
    assert typed_problem(replace(request, typed={})) is None


@pytest.mark.torchrun
def test_a_typed_size_that_cannot_run_stops_every_rank_in_one_line(run_torchrun, tmp_path: Path) -> None:
    """As a user runs it: 4 CPU processes, --tensor-model-parallel-size 3. It probed, named the profiler's
    --tp 3, then fell back to flags Megatron rejects, with a traceback on every rank."""
    args = [*TINY, "--tensor-model-parallel-size", "3", "--auto-parallel", "--auto-parallel-dry-run",
            "--auto-parallel-cache-dir", str(tmp_path)]
    out = run_torchrun(WORKER, args, nproc=4, timeout=240, expect_failure=True)
    # One line per rank: Python writes a SystemExit's text and its newline apart, so two ranks' messages
    # shared a line of the joined output once (one run of four in a fresh clone); each rank writes its
    # line whole now (integration.common.exit_with).
    messages = [line for line in out.splitlines() if "auto-parallel failed" in line]
    assert out.count("auto-parallel failed") == len(messages) == 4 and all(
        m.startswith("auto-parallel failed: rank 0,1,2,3: no layout of this model on 4 processes honours the "
                     "layout flags fixed here (") and "--tensor-model-parallel-size 3): --tensor-model-parallel-size"
        " 3 does not divide the 4 GPUs" in m for m in messages), messages
    assert "probed" not in out and "AssertionError" not in out and "--tp 3" not in out
