"""benchmarks/validation/emulated_cluster.py scores a pinned layout only when the job trained it: a run whose hook
planned again (a flag typed beside the plan that the plan does not match) or trained another layout
stops the benchmark instead of lending its time to the pinned layout."""

import json
from pathlib import Path

import pytest

from benchmarks.validation import emulated_cluster
from megatron_pipette.report.plan_document import PlanRecord

REPO = Path(__file__).resolve().parents[2]

PLAN = REPO / "tests" / "golden" / "plan-llama3-8b-h200x2.json"


def _pinned_log(plan_file: Path, trained: str) -> str:
    return (f"> auto-parallel: using the plan in {plan_file} (allocation abc); probe and profile skipped\n"
            f"> auto-parallel: chosen layout {trained}: --tensor-model-parallel-size 1 ...\n"
            " iteration        1/       5 | elapsed time per iteration (ms): 812.0 |\n")


def test_a_run_that_trained_the_pinned_layout_passes() -> None:
    pinned = PlanRecord.from_json(json.loads(PLAN.read_text()), str(PLAN)).best.layout.describe()
    emulated_cluster.trained_as_pinned(_pinned_log(PLAN, pinned), PLAN)


def test_a_run_that_trained_another_layout_stops_the_benchmark() -> None:
    with pytest.raises(emulated_cluster.MismatchedLayout, match="the job trained tp1 pp1 dp4 mbs4"):
        emulated_cluster.trained_as_pinned(_pinned_log(PLAN, "tp1 pp1 dp4 mbs4"), PLAN)


def test_a_run_whose_hook_planned_again_stops_the_benchmark() -> None:
    """The log of dbd75fe's sweep: the typed --tensor-model-parallel-size 1 made the hook plan again."""
    pinned = PlanRecord.from_json(json.loads(PLAN.read_text()), str(PLAN)).best.layout.describe()
    log = (f"> auto-parallel: WARNING: the plan in {PLAN} cannot run this job (--tensor-model-parallel-size "
           f"is 2 in the plan, 1 fixed here): planning again\n> auto-parallel: chosen layout {pinned}: --x\n")
    with pytest.raises(emulated_cluster.MismatchedLayout, match="the pinned plan was not used"):
        emulated_cluster.trained_as_pinned(log, PLAN)


def test_pinned_runs_type_no_layout_flag() -> None:
    """The flags every run shares leave the layout to the plan (a typed one would override the pin)."""
    from megatron_pipette.integration.megatron_args import typed_flags

    assert typed_flags(emulated_cluster.GPT) == set()
