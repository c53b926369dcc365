"""The cache directory (--auto-parallel-cache-dir) and its one owner.

One directory (an entry) per allocation fingerprint (`cache_key`: the hosts, the GPUs' identities,
the model, the layout flags typed) holds the probe's cluster file, the layer profile, the plan in use
and, once a self-check measured that plan, the calibration fitted to it. Only the process that plans
(torchrun's rank 0) touches it, and only through `Entry`:

* a read decodes the file with its document's one reader; an absent file is None, and so is one that
  cannot be read or decoded (truncated, binary, another schema or version; not a regular file: a
  symbolic link, which is never followed, a FIFO, a device; over files.MAX_DOCUMENT_BYTES), which is
  moved aside (`NAME.corrupt-<time>`) with one warning: the job measures or plans again what it
  needs, and no other file is thrown away;
* a write is atomic (files.write_atomic); one that fails (a read-only cache, a full disk) is one
  warning, and the job goes on with what it computed;
* a lock per entry (fcntl.flock), held from the look-up to the plan and while a self-check records,
  so that concurrent jobs do not interleave their writes;
* safety: directories are created 0700 and files 0600 (0770 and 0660 in a team's cache, the lock
  file included whatever the umask, so that every member of the group can take it), and a cache
  directory or entry owned by another user or writable by others is refused, since its plans would be
  applied; --auto-parallel-shared-cache allows other owners and the group (never everyone). An entry
  that is not a directory of the cache itself (a symbolic link, planted or careless, to a directory
  elsewhere, whose files the job would otherwise read, rename and delete) is moved aside like a bad
  file, and the entry made afresh.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megatron_pipette import __version__
from megatron_pipette.calibration.document import CalibrationRecord
from megatron_pipette.errors import PipetteError
from megatron_pipette.files import read_json, write_atomic
from megatron_pipette.integration.common import log
from megatron_pipette.report.plan_document import PlanRecord
from megatron_pipette.spec.cluster_file import ClusterFile, NodeIdentity
from megatron_pipette.spec.layer_profile import ProfileFile
from megatron_pipette.spec.workload import Workload

FLAG = "--auto-parallel-cache-dir"
SHARED_FLAG = "--auto-parallel-shared-cache"
LOCK = ".lock"
LOCK_POLL_S = 0.1
KEY = re.compile(r"[0-9a-f]{16}")
"""An entry's name (cache_key), and a node's digest (node_digest)."""


@dataclass(frozen=True)
class Document[T]:
    """A file of an entry and its reader (the codec's: raises PipetteError on a bad document)."""

    name: str
    without: str
    """What the job does when the file is unusable."""
    decode: Callable[[Any, str], T]


PLAN = Document("plan.json", "planning again", PlanRecord.from_json)
CLUSTER = Document("cluster.json", "probing again", ClusterFile.from_json)
PROFILE = Document("layer_profile.json", "profiling again", ProfileFile.from_json)
CALIBRATION = Document("calibration.json", "planning uncalibrated", CalibrationRecord.from_json)
LOSS_PLAN = Document("loss_plan.json", "searching after a loss", PlanRecord.from_json)
"""The plan for this allocation less one node (plan.losses), which a restart after a loss places."""


def _node_digests(value: Any, where: str) -> frozenset[str]:
    if not (isinstance(value, dict) and isinstance(value.get("digests"), list)
            and all(isinstance(d, str) and KEY.fullmatch(d) for d in value["digests"])):
        raise PipetteError(f"{where}: not a list of node digests")
    return frozenset(value["digests"])


NODES = Document("nodes.json", "not offering its probe to other allocations", _node_digests)
"""The digests (node_digest) of the nodes the entry's cluster.json measured: what finds it by host."""


def cache_key(identities: list[dict], workload: Workload, typed: Mapping[str, Any]) -> str:
    """The entry of an allocation: each rank's identity (host, device, GPU) in rank order, the model
    and the layout flags typed. Not what a checkpoint fixes: a restart must find the plan it saved."""
    key = {"pipette": __version__, "devices": identities, "model": asdict(workload),
           "constraints": sorted((k, repr(v)) for k, v in typed.items())}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


class Entry:
    """One allocation's directory in the cache, and everything done to its files."""

    def __init__(self, root: str | os.PathLike, key: str, *, shared: bool = False, flag: str = FLAG) -> None:
        self.root, self.key, self.shared, self.flag = Path(root), key, shared, flag
        """`flag`: what chose the root (--auto-parallel-cache-dir, or PIPETTE_CACHE_DIR), named in errors."""
        self.path = self.root / key
        self.dir_mode, self.file_mode = (0o770, 0o660) if shared else (0o700, 0o600)
        self._warned = False
        self._missing = False
        """Set when the entry could not be created: nothing to read."""

    def file(self, doc: Document) -> Path:
        return self.path / doc.name

    def open(self) -> None:
        """Create (or check) the cache directory and this entry. An unsafe one is refused (PipetteError,
        one line); one that cannot be created is one warning: the job goes on without the cache."""
        for directory in (self.root, self.path):
            if directory == self.path:
                self._set_aside_foreign_entry()
            try:
                directory.mkdir(mode=self.dir_mode, parents=directory == self.root)
                os.chmod(directory, self.dir_mode)     # mkdir's mode is cut by the umask
            except FileExistsError:
                pass
            except OSError as e:
                self._cannot_write(f"{self.flag} {directory}: cannot create: {e.strerror or e}")
                self._missing = True
                return
            self._refuse_unsafe(directory)

    def _set_aside_foreign_entry(self) -> None:
        """Move aside an entry that is not a directory inside the cache (a symbolic link to one elsewhere,
        or a file): the link itself is renamed, what it points to is left alone."""
        try:
            st = os.lstat(self.path)
        except OSError:     # absent (made next), or the root is not there to look in
            return
        if stat.S_ISDIR(st.st_mode):
            return
        what = f"a symbolic link to {os.readlink(self.path)}" if stat.S_ISLNK(st.st_mode) else "not a directory"
        move_aside(self.path, f"{self.flag} {self.root}: the entry {self.path} is {what}",
                         "starting the entry afresh")

    def _refuse_unsafe(self, directory: Path) -> None:
        where = f"{self.flag} {self.root}: {directory}"
        try:
            st = os.stat(directory)
        except OSError as e:    # a dangling symbolic link, a component this user cannot search
            link = f" (a symbolic link to {os.readlink(directory)})" if directory.is_symlink() else ""
            raise PipetteError(f"{where}{link}: {e.strerror or e}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise PipetteError(f"{where} is not a directory")
        if st.st_mode & stat.S_IWOTH:
            raise PipetteError(f"{where} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}): anyone could "
                               "plant the plans this job applies; use a directory of your own")
        if self.shared:
            return
        if st.st_uid != os.geteuid():
            raise PipetteError(f"{where} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): use a "
                               f"directory of your own, or {SHARED_FLAG} for a team's cache")
        if st.st_mode & stat.S_IWGRP:
            raise PipetteError(f"{where} is writable by its group (mode {stat.S_IMODE(st.st_mode):o}): use a "
                               f"directory of your own, or {SHARED_FLAG} for a team's cache")

    @contextlib.contextmanager
    def locked(self, timeout_s: float) -> Iterator[float]:
        """Hold the entry's lock; yields the seconds waited for it. Waiting past `timeout_s` is a
        PipetteError. An entry without a lock file (read-only, not created) is used unlocked: nothing
        is written to it either."""
        try:    # flock needs no write access: a lock another member made read-only still serves
            fd = os.open(self.path / LOCK, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, self.file_mode)
        except OSError:
            fd = None
        if fd is not None:
            with contextlib.suppress(OSError):  # O_CREAT's mode is cut by the umask; another's lock stays as it is
                os.fchmod(fd, self.file_mode)
        if fd is None:
            yield 0.0
            return
        try:
            start = time.monotonic()
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() - start > timeout_s:
                        raise PipetteError(f"{self.flag} {self.root}: another job has held {self.path / LOCK} for "
                                           f"{timeout_s:.0f} s") from None
                    time.sleep(LOCK_POLL_S)
                except OSError:     # no locks on this file system (ENOLCK): go on unlocked
                    break
            yield time.monotonic() - start
        finally:
            os.close(fd)    # releases the lock

    def read[T](self, doc: Document[T], of_this_job: Callable[[T], str | None] | None = None) -> T | None:
        """The decoded file, or None: absent, or unusable (then moved aside, with one warning), which
        includes a document `of_this_job` says is another job's (its reason, or None when it is not)."""
        path = self.file(doc)
        if self._missing:
            return None
        try:
            value = read_json(path, self.flag, follow=False, missing_ok=True)
        except FileNotFoundError:
            return None
        except PipetteError as e:    # a link, a FIFO, a device, a directory, too large, unreadable, not JSON
            self._set_aside(doc, str(e))
            return None
        try:
            decoded = doc.decode(value, str(path))
        except PipetteError as e:
            self._set_aside(doc, str(e))
            return None
        except Exception as e:  # noqa: BLE001 (a reader tripping on a malformed field: still only this file)
            self._set_aside(doc, f"{path}: malformed ({type(e).__name__}: {str(e)[:80]})")
            return None
        if of_this_job is not None and (why := of_this_job(decoded)) is not None:
            self._set_aside(doc, f"{path} is not of this job: {why}")
            return None
        return decoded

    def _set_aside(self, doc: Document, reason: str) -> None:
        move_aside(self.file(doc), reason, doc.without)

    def write(self, doc: Document, value: Mapping[str, Any]) -> bool:
        """Store `value` as `doc`, at once; False when it cannot be (warned about once per entry)."""
        return self.write_file(doc.name, (json.dumps(value, indent=1) + "\n").encode())

    def write_file(self, name: str, data: bytes) -> bool:
        """Store `data` as the entry's file `name` (a document's, or a picture no one reads back), at
        once; False when it cannot be (warned about once per entry)."""
        try:
            write_atomic(self.path / name, data, self.flag, self.file_mode)
        except PipetteError as e:
            self._cannot_write(str(e))
            return False
        return True

    def _cannot_write(self, reason: str) -> None:
        if not self._warned:
            log(f"WARNING: {reason}; this job goes on without caching what it measures and plans", 0)
        self._warned = True

    def remove(self, doc: Document) -> None:
        """Drop `doc` (a calibration once the probe or profile it was fitted to is measured again)."""
        with contextlib.suppress(OSError):
            self.file(doc).unlink(missing_ok=True)


def node_digest(node: NodeIdentity) -> str:
    """A node's name in the entries' node indexes: its host and its GPUs' identities, hashed."""
    return hashlib.sha256(repr((node.host, node.gpus)).encode()).hexdigest()[:16]


def node_index(nodes: Sequence[NodeIdentity]) -> dict:
    """The NODES document of an entry whose cluster.json measured `nodes`: what an allocation sharing
    some of them finds it by."""
    return {"digests": [node_digest(node) for node in nodes]}


def node_identities(identities: list[dict], gpus_per_node: int) -> list[NodeIdentity]:
    """Each node's identity from every rank's (the cache key's: host, device, GPU), in rank order."""
    return [NodeIdentity(str(identities[k]["host"]), tuple(ident.get("gpu") for ident in
                                                           identities[k:k + gpus_per_node]))
            for k in range(0, len(identities), gpus_per_node)]


def entries_measuring(entry: Entry, nodes: Sequence[NodeIdentity]) -> list[Entry]:
    """The other entries of `entry`'s cache whose probe measured some of `nodes` (by host and GPUs, not
    by whole allocation), most nodes first, then the most recent. O(entries x nodes): each entry's
    index is read, not its cluster.json; an entry that is unsafe (Entry.open) is passed over."""
    wanted = {node_digest(node) for node in nodes}
    found: list[tuple[int, float, Entry]] = []
    try:
        names = sorted(path.name for path in entry.root.iterdir() if KEY.fullmatch(path.name))
    except OSError:
        return []
    for name in names:
        if name == entry.key or not (entry.root / name).is_dir() or (entry.root / name).is_symlink():
            continue
        other = Entry(entry.root, name, shared=entry.shared)
        try:
            other.open()
        except PipetteError:
            continue
        digests = other.read(NODES)
        if digests and (common := len(wanted & digests)):
            with contextlib.suppress(OSError):
                found.append((common, os.stat(other.file(NODES)).st_mtime, other))
    return [other for _, _, other in sorted(found, key=lambda f: (-f[0], -f[1]))]


def move_aside(path: Path, reason: str, without: str) -> None:
    """Rename a file (or entry) that cannot be used to `NAME.corrupt-<time>`, with one warning saying
    `reason` and what the job does `without` it (the cache's files; a checkpoint's damaged plan)."""
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
    try:
        os.replace(path, aside)
    except OSError as e:
        log(f"WARNING: {reason}; it cannot be moved aside ({e.strerror or e}): {without}", 0)
        return
    log(f"WARNING: {reason}; moved aside to {aside.name}: {without}", 0)
