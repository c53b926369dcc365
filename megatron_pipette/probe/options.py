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
MAX_SECONDS = 7 * 86400.0
"""The longest budget or timeout: no probe runs a week (and torch's timeouts overflow far above)."""
MAX_MESSAGE_BYTES = GiB
"""The largest message: far above what a bandwidth needs (64M by default), below any device's memory."""
MAX_REPEATS = 1000


def check_seconds(value: object, flag: str) -> None:
    """Raise PipetteError naming the flag unless `value` is a number of seconds in (0, MAX_SECONDS]."""
    if not (isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= MAX_SECONDS):
        raise PipetteError(f"{flag} must be a positive number of seconds up to {MAX_SECONDS:.0f}, got {value!r}")


def check_args(budget_s: float, precision: str, small_bytes: int, large_bytes: int, repeats: int) -> None:
    """Raise PipetteError naming the flag for any out-of-range argument."""
    check_seconds(budget_s, "--budget-s")
    if precision not in PRECISIONS:
        raise PipetteError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if not (isinstance(small_bytes, int) and 0 < small_bytes <= MAX_MESSAGE_BYTES):
        raise PipetteError(f"--small-bytes must be a positive integer up to {MAX_MESSAGE_BYTES}, got {small_bytes!r}")
    if not (isinstance(large_bytes, int) and small_bytes < large_bytes <= MAX_MESSAGE_BYTES):
        raise PipetteError(f"--large-bytes must be an integer larger than --small-bytes ({small_bytes}) and up to "
                           f"{MAX_MESSAGE_BYTES}, got {large_bytes!r}")
    if not (isinstance(repeats, int) and 1 <= repeats <= MAX_REPEATS):
        raise PipetteError(f"--repeats must be an integer from 1 to {MAX_REPEATS}, got {repeats!r}")


def out_problem(out: str | os.PathLike | None, flag: str = "--out") -> str | None:
    """Why `out` (given as `flag`) cannot be written (checked on rank 0 before probing), or None."""
    if out is None:
        return None
    try:
        parent = Path(out).resolve().parent
        if not parent.is_dir():
            return f"{flag} {out}: directory {parent} does not exist"
        if not os.access(parent, os.W_OK):
            return f"{flag} {out}: directory {parent} is not writable"
        if Path(out).is_dir():
            return f"{flag} {out}: is a directory"
        if Path(out).exists() and not Path(out).is_file():
            return f"{flag} {out}: not a regular file"
    except (OSError, RuntimeError) as e:        # a name too long, a symlink loop
        return f"{flag} {out}: {getattr(e, 'strerror', None) or e}"
    return None


def parse_size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 2): "4K", "64M"; at most MAX_MESSAGE_BYTES."""
    units = {"k": KiB, "m": MiB, "g": GiB}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        size = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        size = math.nan
    if not (math.isfinite(size) and size == int(size) and 0 < size <= MAX_MESSAGE_BYTES):
        raise argparse.ArgumentTypeError(f"not a byte size from 1 to {MAX_MESSAGE_BYTES // GiB}G: {text!r}")
    return int(size)
