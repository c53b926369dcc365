"""Megatron's real pretrain() trains a tiny GPT on CPU (rehearsal mode) in several layouts."""

import math
import re
from pathlib import Path

import pytest

TINY_GPT = Path(__file__).resolve().parents[2] / "examples" / "tiny_gpt_cpu.sh"
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.eE+-]+|nan|inf)")

# Overrides of the script's TP=2 x PP=2 layout (later flags win in argparse).
LAYOUTS = {
    "tp2-pp2-full-recompute": [
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    ],
    "pp2-interleaved-dp2-selective-recompute": [
        "--tensor-model-parallel-size", "1", "--num-virtual-stages-per-pipeline-rank", "2",
        "--recompute-granularity", "selective",
    ],
    "tp2-dp2-distributed-optimizer": [
        "--pipeline-model-parallel-size", "1", "--use-distributed-optimizer",
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


@pytest.mark.torchrun
@pytest.mark.slow
def test_resume_under_another_layout(run_bounded, tmp_path: Path) -> None:
    """A distributed-optimizer checkpoint saved at TP=2 x DP=2 resumes at PP=2 x DP=2."""
    pytest.importorskip("psutil")  # megatron's torch_dist checkpoint writer needs it
    ckpt = ["--train-iters", "10", "--use-distributed-optimizer",
            "--dist-ckpt-optim-fully-reshardable", "--save", str(tmp_path), "--load", str(tmp_path),
            "--save-interval", "1000"]
    first = run_tiny_gpt(run_bounded, [*ckpt, "--pipeline-model-parallel-size", "1",
                                       "--exit-interval", "6"])
    resumed = run_tiny_gpt(run_bounded, [*ckpt, "--tensor-model-parallel-size", "1"])
    assert sorted(first) == list(range(1, 7))
    assert sorted(resumed) == list(range(7, 11))
    # Training goes on from the saved state instead of starting over (loss ~6.9 at step 1).
    assert resumed[7] < first[6] and resumed[10] < resumed[7], (first, resumed)
