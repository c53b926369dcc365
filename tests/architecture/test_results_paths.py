"""Kept results name no machine: no file under benchmarks/results/ or benchmarks/archive/, and no
member of an archive there, holds an absolute path of the machine a run happened on (its checkout, virtual
environment, scratch folders, system folders). benchmarks/scrub_results.py makes a folder so."""

import gzip
import tarfile
from collections.abc import Iterator
from pathlib import Path

from benchmarks.scrub_results import MACHINE_PATH

ROOT = Path(__file__).resolve().parents[2]
KEPT = [ROOT / "benchmarks" / "results", ROOT / "benchmarks" / "archive"]


def contents(folder: Path) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every file under `folder`, the members of .tar.xz/.tar.gz/.tgz/.gz files
    included ("archive:member")."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(ROOT).as_posix()
        if path.name.endswith((".tar.xz", ".tar.gz", ".tgz")):
            with tarfile.open(path) as tar:
                for member in tar:
                    if member.isfile():
                        yield f"{name}:{member.name}", tar.extractfile(member).read()
        elif path.suffix == ".gz":
            yield name, gzip.decompress(path.read_bytes())
        else:
            yield name, path.read_bytes()


def test_no_absolute_machine_path_under_kept_results():
    assert all(folder.is_dir() for folder in KEPT)
    found = [f"{name}: ...{data[m.start():m.start() + 60].decode(errors='replace').splitlines()[0]}"
             for folder in KEPT for name, data in contents(folder) if (m := MACHINE_PATH.search(data))]
    assert not found, (f"{len(found)} files of kept results name a machine's absolute path "
                       "(python -m benchmarks.scrub_results FOLDER rewrites them):\n" + "\n".join(found[:20]))
