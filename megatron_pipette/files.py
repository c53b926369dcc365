"""Atomic file writes for the parts that do I/O (probe, reports, the hook): readers never see half a file.

The temporary file is made by tempfile.mkstemp in the target's directory (a fresh name opened with
O_EXCL: a name planted in a shared directory, or a link, is never written through), filled,
synced and renamed over the target.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_pipette.errors import PipetteError


def _umask_mode() -> int:
    """The mode a plain open() would give a new file under this process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_atomic(path: str | os.PathLike, data: bytes, flag: str, mode: int | None = None) -> None:
    """Replace `path` with `data` at once. The file gets `mode` (default: what the umask gives). A failed
    write names `flag` (the option that chose the path) and leaves nothing behind."""
    path = Path(path)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, _umask_mode() if mode is None else mode)
            _write_all(fd, data)
            os.fsync(fd)   # a full disk may only say so here
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise PipetteError(f"{flag} {path}: cannot write: {e.strerror or e}") from None


def write_cluster_file(doc: Mapping[str, Any], devices: int, path: str | os.PathLike, flag: str = "--out") -> None:
    """Write a cluster document (the probe's, or its twin's: ClusterFile.to_json) of `devices` devices
    atomically; small ones indented for reading."""
    indent = 1 if devices <= 64 else None
    write_atomic(path, (json.dumps(doc, indent=indent) + "\n").encode(), flag)
