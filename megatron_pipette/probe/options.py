"""Validation of the probe's arguments, without torch.

Why separate: the standalone command rejects a bad flag before it pays for
importing torch and joining the process group, and run_probe applies the
same checks when called in-job.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from megatron_pipette.errors import PipetteError
from megatron_pipette.units import GiB, KiB, MiB

PRECISIONS = ("fp32", "fp16", "bf16", "fp8")


def check_args(budget_s: float, precision: str, small_bytes: int, large_bytes: int, repeats: int) -> None:
    """Raise PipetteError naming the flag for any out-of-range argument."""
    if not (isinstance(budget_s, (int, float)) and math.isfinite(budget_s) and budget_s > 0):
        raise PipetteError(f"--budget-s must be a positive number of seconds, got {budget_s!r}")
    if precision not in PRECISIONS:
        raise PipetteError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if not (isinstance(small_bytes, int) and small_bytes > 0):
        raise PipetteError(f"--small-bytes must be a positive integer, got {small_bytes!r}")
    if not (isinstance(large_bytes, int) and large_bytes > small_bytes):
        raise PipetteError(f"--large-bytes must be an integer larger than --small-bytes ({small_bytes}), "
                           f"got {large_bytes!r}")
    if not (isinstance(repeats, int) and repeats >= 1):
        raise PipetteError(f"--repeats must be a positive integer, got {repeats!r}")


def out_problem(out: str | os.PathLike | None, flag: str = "--out") -> str | None:
    """Why `out` (given as `flag`) cannot be written (checked on rank 0 before probing), or None."""
    if out is None:
        return None
    parent = Path(out).resolve().parent
    if not parent.is_dir():
        return f"{flag} {out}: directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"{flag} {out}: directory {parent} is not writable"
    if Path(out).is_dir():
        return f"{flag} {out}: is a directory"
    return None


def parse_size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 2): "4K", "64M"."""
    units = {"k": KiB, "m": MiB, "g": GiB}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None
