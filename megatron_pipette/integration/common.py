"""What the pre-launch hook and the in-job self-check share: rank-0 log lines and the plan cache.

The cache holds one directory per allocation fingerprint (hook.allocation_fingerprint):
the probe's cluster file, the layer profile, the plan in use and, once a self-check has
measured that plan, the calibration fitted to it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_pipette.files import atomic_path

PLAN = "plan.json"
CLUSTER = "cluster.json"
PROFILE = "layer_profile.json"
CALIBRATION = "calibration.json"


@dataclass
class Phases:
    """Wall time of each pre-launch phase, for the log and the plan file."""

    seconds: dict[str, float] = field(default_factory=dict)
    _start: float = field(default_factory=time.perf_counter)

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        try:
            return fn()
        finally:
            self.seconds[name] = round(time.perf_counter() - t, 3)

    def elapsed(self) -> float:
        return time.perf_counter() - self._start


def log(message: str, rank: int) -> None:
    """Megatron-style rank-0 log line."""
    if rank == 0:
        print(f"> auto-parallel: {message}", flush=True)


def write_json(path: Path, doc: dict, flag: str) -> None:
    """Write atomically; a failure names the flag that chose the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, flag) as tmp:
        tmp.write_text(json.dumps(doc, indent=1))


def candidate_digest(candidate: dict) -> str:
    """Identifies a plan's chosen candidate: ranks agree on it, the self-check finds it again."""
    return hashlib.sha256(json.dumps(candidate, sort_keys=True).encode()).hexdigest()
