"""Atomic file writes for the parts that do I/O (probe, reports, the hook): readers never see half a file."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from megatron_pipette.errors import PipetteError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, flag: str) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write to; it replaces `path` when the block ends.
    A failed write names `flag` (the option that chose the path) and leaves nothing behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PipetteError(f"{flag} {path}: cannot write: {e.strerror or e}") from None


def write_cluster_file(doc: dict, path: str | os.PathLike, flag: str = "--out") -> None:
    """Write a cluster document (the probe's, or its twin's) atomically; small ones indented for reading."""
    indent = 1 if doc["num_nodes"] * doc["gpus_per_node"] <= 64 else None
    with atomic_path(path, flag) as tmp:
        tmp.write_text(json.dumps(doc, indent=indent) + "\n")
