"""benchmarks/validation/in_job.py, the in-job GPU check: its starts leave the layout to the planner and
share one schedule, and its summary reads the hook's lines as the hook writes them. Runs on CPU; the
starts themselves are for the GPU machine (`--dry-run` checks them on CPU in about two minutes)."""

from pathlib import Path

from benchmarks.validation import in_job
from megatron_pipette.integration.megatron_args import typed_flags


def test_the_starts_type_no_layout_flag_and_plan_automatically(tmp_path: Path) -> None:
    for dry_run in (False, True):
        line = in_job.flags(dry_run, 40, tmp_path, 90.0)
        assert typed_flags(line) == set()
        assert "--auto-parallel" in line and line[line.index("--train-iters") + 1] == "40"


def test_the_summary_keeps_the_hook_lines_a_person_reads_first() -> None:
    text = ("> auto-parallel: probed 1 devices on 1 node(s) in 1.0 s\n"
            "[rank0]: > auto-parallel: chosen layout tp1 pp1 dp1 mbs2: --tensor-model-parallel-size 1\n"
            "> auto-parallel: predicted 0.6090 s/iteration, peak 47.3 GiB of 139 GiB per device\n"
            "> auto-parallel: self-check, iterations 2-6: predicted 0.609 s/iteration, measured 0.611 s (+0.3%)\n")
    row = {"name": "first", "exit_code": 0, "wall_s": 80.0, "first_iteration": 1, "step_s": 0.61,
           "max_allocated_bytes": 1, "hook": in_job.HOOK.findall(text), "losses": [7.0, 6.5]}
    lines = in_job.summary(row)
    assert any(line.strip().startswith("chosen layout tp1 pp1 dp1 mbs2") for line in lines)
    assert any("self-check" in line and "+0.3%" in line for line in lines)
    assert not any("probed" in line for line in lines)
