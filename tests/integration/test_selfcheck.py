"""The in-job self-check and the calibration loop, on a launch line written for GPUs (Megatron's
defaults: NCCL, Transformer Engine's spec, fused kernels) run on CPU under --auto-parallel."""

import json
import re
import shutil
from pathlib import Path

import pytest

from helpers.plans import chosen, plan_doc
from megatron_pipette.cost.memory import StageMemory
from megatron_pipette.report.plan_document import PlanRecord
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt.py"
GPU_LINE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--untie-embeddings-and-output-weights", "--global-batch-size", "16",
            "--vocab-size", "1024", "--tokenizer-type", "NullTokenizer", "--mock-data", "--num-workers", "0",
            "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000"]
TIME_LINE = re.compile(r"> auto-parallel: self-check, iterations 2-4: predicted ([0-9.e+-]+) s/iteration, "
                       r"measured ([0-9.e+-]+) s \(([+-][0-9.]+)%\)\n")
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.eE+-]+)")


def auto_parallel(cache: Path, *extra: str) -> list[str]:
    return [*GPU_LINE, "--auto-parallel", "--auto-parallel-cache-dir", str(cache), "--auto-parallel-budget-s", "60",
            *extra]


@pytest.fixture(scope="module")
def checked_job(run_torchrun, tmp_path_factory) -> tuple[str, Path]:
    """One launch, several tests: plan, train 6 iterations, self-check iterations 2-4."""
    cache = tmp_path_factory.mktemp("cache")
    out = run_torchrun(EXAMPLE, auto_parallel(cache, "--train-iters", "6", "--auto-parallel-check-iterations", "3"),
                       nproc=2, timeout=240)
    (directory,) = cache.iterdir()
    return out, directory


@pytest.mark.torchrun
def test_a_gpu_launch_line_trains_on_cpu_and_checks_itself(checked_job) -> None:
    """The hook switches the line to what CPU needs (and says so), Megatron does not try to rebuild
    its prebuilt dataset helpers, training runs past the check, and the check is logged and
    recorded in the cached plan (passes inside the schedule inside the step), and drawn beside it."""
    out, directory = checked_job
    assert ("> auto-parallel: CPU rehearsal: --distributed-backend gloo (not nccl: NCCL needs GPUs), "
            "--transformer-impl local (Transformer Engine is not installed), --no-persist-layer-norm, "
            "--no-gradient-accumulation-fusion") in out
    assert sorted(int(i) for i, _ in LOSS.findall(out)) == list(range(1, 7))
    (line,) = TIME_LINE.findall(out)
    predicted, measured, error = map(float, line)
    memory_line = re.search(r"> auto-parallel: self-check: peak memory per stage predicted [0-9./]+ GiB; on CPU, "
                            r"tensors counted per stage: model state predicted [0-9./]+, counted [0-9./]+ MiB; "
                            r"activations predicted [0-9./]+, counted [0-9./]+ MiB\n", out)
    assert memory_line, out[-3000:]
    doc = json.loads((directory / "plan.json").read_text())
    check = doc["self_check"]
    assert check["iterations"] == [2, 4] and check["missing_ranks"] == []
    assert f"{check['predicted_s']:.3g}" == line[0] and f"{check['measured_s']:.3g}" == line[1]
    assert error == pytest.approx(100 * (check["measured_s"] / check["predicted_s"] - 1), abs=0.06)
    layout, _ = chosen(doc)
    assert [s["stage"] for s in check["stages"]] == list(range(layout.pp))
    assert sum(s["ranks"] for s in check["stages"]) == 2
    for stage in check["stages"]:
        assert 0 < stage["compute_s"] < check["forward_backward_s"] < check["measured_s"], check
        assert stage["measured_peak_bytes"] is None
        # The tensors counted against the memory model's terms (docs/validation.md has the table).
        for term in ("model state", "activations"):
            assert 0.75 < stage["measured_tensors"][term] / stage["predicted_tensors"][term] < 1.25, stage
    chart = directory / "self_check.png"      # beside the JSON: time and tensors per stage
    assert chart.read_bytes().startswith(b"\x89PNG") and f"self-check chart written to {chart}" in out


@pytest.mark.torchrun
def test_the_next_start_plans_with_the_calibrated_model(run_torchrun, checked_job, tmp_path) -> None:
    """The check's factors are stored; a second start on the allocation plans again with them,
    predicts the measured layout at what the check measured, and records the calibration it used.
    It starts on a copy of the cache: its plan replaces the entry's, which the other tests read."""
    out, checked = checked_job
    directory = tmp_path / "cache" / checked.name
    shutil.copytree(checked.parent, directory.parent)
    calibration = json.loads((directory / "calibration.json").read_text())
    first = json.loads((directory / "plan.json").read_text())
    assert calibration["fitted_on"]["measured_s"] == first["self_check"]["measured_s"]
    assert "> auto-parallel: calibration: compute x" in out
    assert f"calibration stored in {checked / 'calibration.json'}" in out
    again = run_torchrun(EXAMPLE, auto_parallel(directory.parent, "--train-iters", "6", "--auto-parallel-dry-run",
                                                "--auto-parallel-replan-if-slower", "0"), nproc=2, timeout=180)
    assert "a self-check calibrated the model since" in again and "probed" not in again
    layout = chosen(first)[0].describe()
    fitted = calibration["fitted_on"]
    assert (f"> auto-parallel: {layout}: predicted {fitted['calibrated_s']:.3g} s/iteration by the calibrated "
            f"model, {first['candidates'][0]['iteration_time_s']:.3g} s before") in again
    if not fitted["notes"]:
        assert fitted["calibrated_s"] == pytest.approx(fitted["measured_s"], rel=1e-3)
    replanned = json.loads((directory / "plan.json").read_text())
    assert replanned["calibration"]["id"] == calibration["id"]
    assert "self_check" not in replanned


@pytest.mark.megatron
def test_a_rank_that_never_reports_holds_the_check_only_briefly(monkeypatch, capsys) -> None:
    """Rank 1 died before the check: torchrun's rank 0 waits out REPORT_WAIT_S for its record, then
    compares the ranks that did report and says which did not."""
    import time

    import torch.distributed as dist

    from megatron_pipette.calibration.check import RankSample
    from megatron_pipette.integration import selfcheck

    monkeypatch.setattr(selfcheck, "REPORT_WAIT_S", 0.5)
    store = dist.HashStore()
    doc = plan_doc(workload_from_preset("tiny-gpt"), Layout(data_parallel_size=4))
    doc["candidates"][0]["iteration_time_s"] = 1.0
    setup = selfcheck.CheckSetup(store=store, prefix="pipette/0/check/", iterations=3,
                                 plan=PlanRecord.from_json(doc, "plan"), record=None, concludes=True, on_gpu=False)
    mine = RankSample(rank=0, stage=0, iteration_s=1.2, forward_backward_s=1.1, compute_s=0.9, memory=None)
    store.set("pipette/0/check/0", json.dumps(mine.as_json()))
    start = time.monotonic()
    selfcheck._conclude(setup, world=2)
    assert time.monotonic() - start < 5
    out = capsys.readouterr().out
    assert "> auto-parallel: self-check, iterations 2-4: predicted 1 s/iteration, measured 1.2 s (+20.0%)" in out
    assert "> auto-parallel: self-check: rank(s) 1 did not report; compared without them" in out
    assert "self-check not recorded: the plan is pinned by --auto-parallel-plan-file" in out


@pytest.mark.megatron
def test_the_chart_is_drawn_beside_the_json_and_a_failure_to_draw_is_one_warning(monkeypatch, capsys, tmp_path):
    from megatron_pipette.calibration.check import RankSample, compare
    from megatron_pipette.integration import selfcheck
    from megatron_pipette.integration.cache import Entry
    from megatron_pipette.report import check_chart

    entry = Entry(tmp_path / "cache", "k")
    entry.open()
    stage = StageMemory(stage=0, parameters=1, weight_bytes=1, gradient_bytes=1, optimizer_bytes=1, activation_bytes=1,
                        transient_bytes=1, overhead_bytes=1)
    result = compare(1.0, (stage,), [RankSample(rank=0, stage=0, iteration_s=1.2, forward_backward_s=1.1, compute_s=0.9,
                                            memory=None)], (2, 4))
    selfcheck._draw(entry, result, None)
    chart = entry.path / selfcheck.CHECK_CHART
    assert chart.read_bytes().startswith(b"\x89PNG") and chart.stat().st_size > 10_000
    assert f"> auto-parallel: self-check chart written to {chart}" in capsys.readouterr().out

    def broken(*_):
        raise ValueError("no fonts")

    chart.unlink()
    monkeypatch.setattr(check_chart, "check_chart", broken)
    selfcheck._draw(entry, result, None)
    assert capsys.readouterr().out == "> auto-parallel: WARNING: self-check chart not drawn: ValueError: no fonts\n"
    assert not chart.exists()
