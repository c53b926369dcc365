"""Megatron's real pretrain() trains a tiny GPT on CPU (rehearsal mode), without the hook."""

import math
import re
from pathlib import Path

import pytest

TINY_GPT = Path(__file__).resolve().parents[2] / "examples" / "tiny_gpt_cpu.sh"
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.eE+-]+|nan|inf)")

# Overrides of the script's TP=2 x PP=2 layout (later flags win in argparse). One job carrying as many
# features as it can (every job costs ~25 s of start-up on 2 cores); TP 2 x PP 2 itself trains in
# tests/integration/test_autoparallel.py, full recomputation in its resume test.
LAYOUTS = {
    "pp2-interleaved-dp2-selective-recompute-distributed-optimizer": [
        "--tensor-model-parallel-size", "1", "--num-virtual-stages-per-pipeline-rank", "2",
        "--recompute-granularity", "selective", "--use-distributed-optimizer",
        "--overlap-grad-reduce", "--overlap-param-gather",
    ],
}


def losses(output: str) -> dict[int, float]:
    """lm loss per iteration, as logged by the last pipeline stage."""
    return {int(it): float(loss) for it, loss in LOSS.findall(output)}


def run_tiny_gpt(run_bounded, extra: list[str]) -> dict[int, float]:
    """Run examples/tiny_gpt_cpu.sh (it launches torchrun itself) and return its losses."""
    return losses(run_bounded(["bash", str(TINY_GPT), *extra], timeout=180))


@pytest.mark.torchrun
@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_tiny_gpt_loss_falls(run_bounded, layout: str) -> None:
    got = run_tiny_gpt(run_bounded, ["--train-iters", "10", *LAYOUTS[layout]])
    assert sorted(got) == list(range(1, 11))
    assert all(math.isfinite(v) for v in got.values())
    assert got[10] < got[1] - 0.3, got
