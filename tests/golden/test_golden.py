"""Golden `pipette plan --json` / `pipette estimate --json` outputs for a handful of presets.

Why: every change to a plan (a model term, the search, the placement, a refactor that should
change nothing) shows up as a readable diff of these files. A refactor keeps them byte-identical;
a deliberate model change regenerates them and the diff is reviewed with it:

    PIPETTE_REGENERATE_GOLDEN=1 .venv/bin/python -m pytest tests/golden
"""

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from megatron_pipette.cli.main import main
from megatron_pipette.report.plan_document import PlanRecord

HERE = Path(__file__).parent
CASES = {
    "plan-default": ["plan", "--json", "--top", "5"],
    "plan-gpt3-175b-a100x128": ["plan", "--model", "gpt3-175b", "--cluster", "dgx-a100", "--num-nodes", "128",
                                "--json", "--top", "5"],
    "plan-llama2-70b-h100x8-tp8": ["plan", "--model", "llama2-70b", "--cluster", "dgx-h100", "--num-nodes", "8",
                                   "--tensor-model-parallel-size", "8", "--json", "--top", "5"],
    "plan-llama3-8b-h200x2": ["plan", "--model", "llama3-8b", "--cluster", "dgx-h200", "--num-nodes", "2",
                              "--json", "--top", "5"],
    "plan-gpt3-1.3b-slow-node": ["plan", "--model", "gpt3-1.3b", "--cluster", str(HERE / "slow_node_cluster.json"),
                                 "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4", "--json",
                                 "--top", "5"],
    "estimate-gpt3-175b-a100x128": ["estimate", "--model", "gpt3-175b", "--num-nodes", "128",
                                    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
                                    "--num-layers-per-virtual-pipeline-stage", "3", "--sequence-parallel", "--json"],
    "estimate-gpt3-13b-v100x4-fp16": ["estimate", "--model", "gpt3-13b", "--cluster", "dgx-v100", "--fp16",
                                      "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
                                      "--recompute-granularity", "selective", "--json"],
}


def run_cli(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


@pytest.mark.parametrize("name", sorted(CASES))
def test_output_matches_golden(name):
    path = HERE / f"{name}.json"
    got = run_cli(CASES[name])
    if os.environ.get("PIPETTE_REGENERATE_GOLDEN") == "1":
        path.write_text(got)
    assert path.exists(), f"no golden file {path.name}; regenerate with PIPETTE_REGENERATE_GOLDEN=1"
    assert got == path.read_text(), f"{name}: the plan changed; diff it against {path.name}"


@pytest.mark.parametrize("name", sorted(n for n in CASES if n.startswith("plan-")))
def test_a_plan_document_reads_and_writes_back_unchanged(name: str) -> None:
    """Plans written before the typed record (these files) keep their format through its reader and writer."""
    doc = json.loads((HERE / f"{name}.json").read_text())
    assert PlanRecord.from_json(doc, name).to_json() == doc
