"""The `--auto-parallel` flags, as Megatron-style arguments added to Megatron's own parser, and the
environment variables beside them.

A bad value of a flag is argparse's one error naming the flag; a bad value of a variable is refused by
`check_options`, which the hook runs first on every rank, before any rank waits for another.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from pathlib import Path

from megatron_pipette.errors import PipetteError

ENV_VAR = "PIPETTE_AUTO_PARALLEL"
REHEARSAL_ENV_VAR = "PIPETTE_CPU_REHEARSAL"
"""integration.rehearsal's switch (named here, where no torch is imported)."""
CACHE_ENV_VAR = "PIPETTE_CACHE_DIR"
CACHE_FLAG = "--auto-parallel-cache-dir"
DEFAULT_BUDGET_S = 120.0
MAX_BUDGET_S = 86400.0
"""A day: far beyond any probe and profile, and a bound the pre-launch timeouts can be computed from."""
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "megatron-pipette"
DEFAULT_CHECK_ITERATIONS = 5
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"", "0", "false", "no", "off"})
"""The spellings of a switch variable (PIPETTE_AUTO_PARALLEL, PIPETTE_CPU_REHEARSAL), in any case."""


def env_switch(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A switch variable's value; a spelling of neither is a PipetteError naming it (silently off, a
    `yes` once left a job unplanned)."""
    value = (os.environ if environ is None else environ).get(name, "")
    word = value.strip().lower()
    if word in TRUE_WORDS | FALSE_WORDS:
        return word in TRUE_WORDS
    raise PipetteError(f"{name}={value!r}: must be one of {', '.join(sorted(TRUE_WORDS))} (on) or "
                       f"{', '.join(sorted(FALSE_WORDS - {''}))} (off)")


def _env_asks(name: str) -> bool:
    """Whether a switch variable is set to anything but off: an unknown word counts, so that the hook
    runs and refuses it (check_options) instead of leaving the job silently unplanned."""
    return os.environ.get(name, "").strip().lower() not in FALSE_WORDS


def _path(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name a file or directory, got {text!r} (an empty path is the "
                                          "working directory)")
    return Path(text)


def _number(text: str) -> float:
    """The number `text` spells; nan when it spells none, which every range below refuses."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


def _seconds(text: str) -> float:
    value = _number(text)
    if not (math.isfinite(value) and 0 < value <= MAX_BUDGET_S):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0 and at most {MAX_BUDGET_S:g}, "
                                          f"got {text!r}")
    return value


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number of 0 or more, got {text!r}")
    return int(text)


def _percent(text: str) -> float:
    value = _number(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a percentage of 0 or more, got {text!r}")
    return value


def _headroom(text: str) -> float:
    value = _percent(text)
    if not value < 100:
        raise argparse.ArgumentTypeError(f"must be a percentage under 100, got {text!r}")
    return value


def requested(argv: list[str]) -> bool:
    """Whether this launch asks for auto-parallel (flag or environment)."""
    return "--auto-parallel" in argv or _env_asks(ENV_VAR)


def cache_dir(opts: argparse.Namespace, environ: Mapping[str, str] | None = None) -> tuple[Path, str]:
    """The cache directory and what chose it (the flag, the variable, or neither: the default), for the
    messages that name it. An empty PIPETTE_CACHE_DIR is a PipetteError: it would make the working
    directory the cache."""
    environ = os.environ if environ is None else environ
    if opts.auto_parallel_cache_dir is not None:
        return opts.auto_parallel_cache_dir, CACHE_FLAG
    if CACHE_ENV_VAR not in environ:
        return DEFAULT_CACHE_DIR, CACHE_FLAG
    if not environ[CACHE_ENV_VAR].strip():
        raise PipetteError(f"{CACHE_ENV_VAR}={environ[CACHE_ENV_VAR]!r}: empty, which would make the working "
                           f"directory the cache; name a directory, or unset it for {DEFAULT_CACHE_DIR}")
    return Path(environ[CACHE_ENV_VAR]), CACHE_ENV_VAR


def check_options(opts: argparse.Namespace, environ: Mapping[str, str] | None = None) -> None:
    """Refuse, in one PipetteError naming it, a variable the flags depend on set to a value they cannot
    take (the flags' own values argparse checked as it parsed them)."""
    for name in (ENV_VAR, REHEARSAL_ENV_VAR):
        env_switch(name, environ)
    cache_dir(opts, environ)


def add_auto_parallel_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's `extra_args_provider` shape: take the parser, add a group, return it."""
    group = parser.add_argument_group("megatron-pipette auto-parallel")
    group.add_argument("--auto-parallel", action="store_true", default=_env_asks(ENV_VAR),
                       help="probe the allocated GPUs, plan the fastest layout that fits and a rank placement, "
                            "and train with it (flags given explicitly are kept as constraints)")
    group.add_argument("--auto-parallel-budget-s", type=_seconds, default=DEFAULT_BUDGET_S,
                       help=f"time budget for the whole pre-launch phase, seconds (default {DEFAULT_BUDGET_S:g}, "
                            f"at most {MAX_BUDGET_S:g})")
    group.add_argument(CACHE_FLAG, type=_path, default=None,
                       help="where probes and plans are kept, keyed by allocation and model "
                            "(default $PIPETTE_CACHE_DIR or ~/.cache/megatron-pipette)")
    group.add_argument("--auto-parallel-shared-cache", action="store_true",
                       help="the cache directory is a team's: accept one owned by another user or writable by "
                            "its group (never one writable by everyone), and write it group-readable and -writable")
    group.add_argument("--auto-parallel-plan-file", type=_path, default=None,
                       help="use the best candidate of this plan JSON instead of planning, if it can run this job "
                            "(else plan again, with a warning)")
    group.add_argument("--auto-parallel-replan", action="store_true",
                       help="plan again from the cached probe and layer profile instead of reusing the cached plan")
    group.add_argument("--auto-parallel-reprobe", action="store_true",
                       help="probe and profile again instead of reusing the cached measurements (drops their "
                            "calibration), then plan")
    group.add_argument("--auto-parallel-dry-run", action="store_true",
                       help="print the plan (checked against this job like any other) and exit without training "
                            "(status 1 if planning failed)")
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
    from megatron_pipette.plan.planner import HEADROOM_TIME, MEMORY_HEADROOM  # not at start-up (autoload)

    group.add_argument("--auto-parallel-memory-headroom", type=_headroom, default=100 * MEMORY_HEADROOM,
                       metavar="PCT",
                       help="leave PCT%% of device memory free: a layout that leaves less is passed over for one "
                            f"that leaves it within {100 * HEADROOM_TIME:g}%% of its time (if none does, the "
                            f"fastest that fits) (default {100 * MEMORY_HEADROOM:g})")
    return parser
