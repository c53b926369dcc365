"""What the pre-launch hook and the in-job self-check share: rank-0 log lines, phase times, plan digests."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn


@dataclass
class Phases:
    """Wall time of each pre-launch phase (for the log and the plan file), and the phases skipped."""

    seconds: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    """Phase -> why it did not run ("cached", "pinned plan")."""
    budget_s: float = math.inf
    """--auto-parallel-budget-s, which the phases share: work a start can do without (the plan for the
    loss of a node) is left out when it would not fit what is left (`left`)."""
    _start: float = field(default_factory=time.perf_counter)

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        try:
            return fn()
        finally:
            self.seconds[name] = round(time.perf_counter() - t, 3)

    def skip(self, name: str, why: str) -> None:
        self.skipped.setdefault(name, why)

    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def line(self) -> str:
        """"probe 1.5 s, profile 2.0 s, plan 0.1 s; total 4.1 s", or for a start that reused the cache
        "probe, profile and plan cached; total 0.1 s"."""
        ran = [f"{k} {v:.1f} s" for k, v in self.seconds.items()]
        by_why: dict[str, list[str]] = {}
        for name, why in self.skipped.items():
            if name not in self.seconds:
                by_why.setdefault(why, []).append(name)
        skipped = [(", ".join(names[:-1]) + " and " if len(names) > 1 else "") + f"{names[-1]} {why}"
                   for why, names in by_why.items()]
        return ", ".join([*skipped, *ran] or ["none"]) + f"; total {self.elapsed():.1f} s"


def exit_with(message: str) -> NoReturn:
    """End this rank with `message` as one line on stderr (exit status 1). Python prints a SystemExit's
    text and its newline in two writes, so two ranks' messages could share a line of a joined log."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    raise SystemExit(1)


def log(message: str, rank: int) -> None:
    """Megatron-style rank-0 log line."""
    if rank == 0:
        print(f"> auto-parallel: {message}", flush=True)
