"""Atomic file writes and bounded reads for the parts that do I/O (probe, reports, the hook, the CLI):
readers never see half a file, and a document is read only from a regular file of bounded size, a
JSON one with one set of errors (read_json).

The temporary file is made by tempfile.mkstemp in the target's directory (a fresh name opened with
O_EXCL: a name planted in a shared directory, or a link, is never written through), filled,
synced and renamed over the target.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_pipette.errors import PipetteError

MAX_DOCUMENT_BYTES = 1 << 30
"""Largest document read (1 GiB): several times a probe's cluster file of 16,384 GPUs, small enough
that a runaway file ends in one line instead of a process out of memory."""


def read_bounded(path: str | os.PathLike, flag: str, *, limit: int | None = None, follow: bool = True) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them (default MAX_DOCUMENT_BYTES).
    Anything else is a PipetteError naming `flag`: a FIFO (opened without blocking, so no writer is
    waited for), a device such as /dev/zero, a directory, a file over the limit, and with
    `follow=False` a symbolic link (O_NOFOLLOW: a link planted in a cache is never read through).
    An absent file raises FileNotFoundError, for the callers to whom absence is an answer."""
    where, limit = f"{flag} {path}", MAX_DOCUMENT_BYTES if limit is None else limit
    nofollow = 0 if follow else os.O_NOFOLLOW
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | nofollow)
    except FileNotFoundError:
        raise
    except OSError as e:
        if not follow and os.path.islink(path):
            raise PipetteError(f"{where}: a symbolic link, not a regular file (links are not followed here)") from None
        raise PipetteError(f"{where}: cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PipetteError(f"{where}: not a regular file ({_kind(st.st_mode)})")
        if st.st_size > limit:
            raise PipetteError(f"{where}: {st.st_size} bytes, over the {limit} bytes read")
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:    # grew while read
            raise PipetteError(f"{where}: over the {limit} bytes read")
        return b"".join(chunks)
    except OSError as e:
        raise PipetteError(f"{where}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike, flag: str, *, limit: int | None = None, follow: bool = True,
              missing_ok: bool = False) -> Any:
    """The JSON document in `path`, read as read_bounded reads it (`limit`, `follow`). Anything that is
    not one (not UTF-8 text, not valid JSON, a number or a nesting the parser refuses) is a PipetteError
    naming `flag`, written here once for every reader. An absent file is one too, unless `missing_ok`:
    then FileNotFoundError reaches the callers to whom absence is an answer."""
    where = f"{flag} {path}"
    try:
        data = read_bounded(path, flag, limit=limit, follow=follow)
    except FileNotFoundError:
        if missing_ok:
            raise
        raise PipetteError(f"{where}: no such file") from None
    try:
        return json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise PipetteError(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise PipetteError(f"{where}: not a JSON file (not UTF-8 text)") from None
    except (ValueError, RecursionError) as e:      # an integer of 4,300 digits, arrays nested thousands deep
        raise PipetteError(f"{where}: not valid JSON ({type(e).__name__})") from None
    except MemoryError:
        raise PipetteError(f"{where}: too large to read") from None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return f"mode {mode:o}"


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
