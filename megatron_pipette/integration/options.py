"""The `--auto-parallel` flags, as Megatron-style arguments added to Megatron's own parser."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

ENV_VAR = "PIPETTE_AUTO_PARALLEL"
DEFAULT_BUDGET_S = 120.0
DEFAULT_CACHE_DIR = Path(os.environ.get("PIPETTE_CACHE_DIR", Path.home() / ".cache" / "megatron-pipette"))
DEFAULT_CHECK_ITERATIONS = 5


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number of 0 or more, got {text!r}")
    return int(text)


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a percentage of 0 or more, got {text!r}")
    return value


def requested(argv: list[str]) -> bool:
    """Whether this launch asks for auto-parallel (flag or environment)."""
    return "--auto-parallel" in argv or os.environ.get(ENV_VAR) == "1"


def add_auto_parallel_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's `extra_args_provider` shape: take the parser, add a group, return it."""
    group = parser.add_argument_group("megatron-pipette auto-parallel")
    group.add_argument("--auto-parallel", action="store_true", default=os.environ.get(ENV_VAR) == "1",
                       help="probe the allocated GPUs, plan the fastest layout that fits and a rank placement, "
                            "and train with it (flags given explicitly are kept as constraints)")
    group.add_argument("--auto-parallel-budget-s", type=float, default=DEFAULT_BUDGET_S,
                       help=f"time budget for the whole pre-launch phase, seconds (default {DEFAULT_BUDGET_S:g})")
    group.add_argument("--auto-parallel-cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                       help="where probes and plans are kept, keyed by allocation and model "
                            "(default $PIPETTE_CACHE_DIR or ~/.cache/megatron-pipette)")
    group.add_argument("--auto-parallel-shared-cache", action="store_true",
                       help="the cache directory is a team's: accept one owned by another user or writable by "
                            "its group (never one writable by everyone), and write it group-readable and -writable")
    group.add_argument("--auto-parallel-plan-file", type=Path, default=None,
                       help="use the best candidate of this plan JSON instead of planning, if it can run this job "
                            "(else plan again, with a warning)")
    group.add_argument("--auto-parallel-replan", action="store_true",
                       help="plan again from the cached probe and layer profile instead of reusing the cached plan")
    group.add_argument("--auto-parallel-reprobe", action="store_true",
                       help="probe and profile again instead of reusing the cached measurements (drops their "
                            "calibration), then plan")
    group.add_argument("--auto-parallel-dry-run", action="store_true",
                       help="print the plan (checked against this job like any other) and exit without training")
    group.add_argument("--auto-parallel-strict", action="store_true",
                       help="stop with an error if probing or planning fails, instead of training with "
                            "the flags as given")
    group.add_argument("--auto-parallel-check-iterations", type=_count, default=DEFAULT_CHECK_ITERATIONS,
                       metavar="N",
                       help="after the first iteration, time N more, compare them with the plan's predictions and "
                            "calibrate the model for the next start on this allocation "
                            f"(default {DEFAULT_CHECK_ITERATIONS}; 0: no self-check)")
    group.add_argument("--auto-parallel-replan-if-slower", type=_percent, default=None, metavar="PCT",
                       help="when a start finds a calibration of this allocation, switch to the layout the calibrated "
                            "model finds more than PCT%% faster than the cached plan's (default: keep the cached "
                            "layout and log what the calibrated model would choose)")
    return parser
