"""Make a results folder fit for the repository: no machine's absolute paths, raw logs packed.

    python -m benchmarks.scrub_results benchmarks/results/NAME [...] [--map PREFIX=REPLACEMENT]
        [--pack [--keep GLOB ...]]

Why: a run's logs and documents name the folders of the machine it ran on (its checkout, its
virtual environment, scratch folders, tracebacks through site-packages). Those paths mean
nothing elsewhere and say where someone worked; the numbers around them are the evidence.

What it does, to every file of each folder (bytes, so any encoding survives; numbers untouched):
- an absolute path down to a virtual environment becomes `<venv>/...`;
- each `--map PREFIX=REPLACEMENT`, then this checkout's own root, is replaced (a checkout's root
  by nothing, so its paths become repository-relative: `--map /srv/ckout/=`);
- a home folder becomes `<home>/...` and any other absolute path `<top>/...`, its first
  component in brackets (`<tmp>/run1/plan.json`, `<usr>/local`); a Windows drive `<drive>`.
With `--pack`, every file not matched by a `--keep` glob (default: the folder's top-level files,
the run's summary and printed output) moves into the folder's `logs.tar.xz`, under the same
relative path (`tar -xJf logs.tar.xz` restores them). The archive is reproducible: members
sorted, no times, owners or modes of the machine. xz, not gzip: node logs repeat across files
further apart than gzip's 32 KiB window (the emulated-cluster runs pack 8x smaller).

tests/architecture/test_results_paths.py fails while any file under benchmarks/results/, or any member of an
archive there, matches MACHINE_PATH.
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import re
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHIVE = "logs.tar.xz"
TOPS = ("work", "root", "home", "Users", "tmp", "var", "usr", "opt", "mnt", "srv", "scratch", "data",
        "lib", "lib64", "etc", "proc", "dev", "sys", "private", "Volumes", "__w", "pytorch")
"""First components of an absolute path that belong to a machine (`__w` and `pytorch` are the
folders PyTorch is built in, named in its compiled-in messages)."""
_START = rb"(?<![\w.~/<>-])"
"""An absolute path starts a token: not inside a relative path, a URL or a placeholder."""
_TOP = rb"/(" + rb"|".join(t.encode() for t in TOPS) + rb")/(?=[\w.@+-])"
_DRIVE = rb"(?<![\w])[A-Z]:(?=(?:\\\\?|/)[\w.$])"
MACHINE_PATH = re.compile(_START + _TOP + rb"|" + _DRIVE)
"""An absolute path of some machine: a known top folder followed by a path, or a drive letter."""
_VENV = re.compile(_START + rb"/(?:[\w.@+-]+/)*?\.venv/")
_HOME = re.compile(_START + rb"/(?:root/|home/[\w.@+-]+/|Users/[\w.@+-]+/)")


def scrub(data: bytes, maps: list[tuple[bytes, bytes]]) -> bytes:
    """`data` with every absolute machine path made repository-relative or a placeholder."""
    data = _VENV.sub(b"<venv>/", data)
    for prefix, replacement in maps:
        data = re.sub(_START + re.escape(prefix), replacement.replace(b"\\", b"\\\\"), data)
    data = _HOME.sub(b"<home>/", data)
    data = re.compile(_START + _TOP).sub(rb"<\1>/", data)
    return re.compile(_DRIVE).sub(b"<drive>", data)


def kept(rel: str, globs: list[str]) -> bool:
    """Whether the relative path `rel` matches a glob of the same depth."""
    return any(rel.count("/") == g.count("/") and fnmatch.fnmatchcase(rel, g) for g in globs)


def pack(folder: Path, keep: list[str]) -> list[str]:
    """Move the files of `folder` that `keep` does not match into its ARCHIVE; their names."""
    archive = folder / ARCHIVE
    if archive.exists():
        raise SystemExit(f"error: {archive} exists: unpack it first (tar -xJf), then pack again")
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    files = [name for name in names if not kept(name, keep)]
    if not files:
        return []
    with tarfile.open(archive, "w:xz", format=tarfile.GNU_FORMAT, preset=9) as tar:
        for name in files:
            data = (folder / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    for name in files:
        (folder / name).unlink()
    for d in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    return files


def parse_map(text: str) -> tuple[bytes, bytes]:
    prefix, sep, replacement = text.partition("=")
    if not sep or not prefix.startswith("/"):
        raise argparse.ArgumentTypeError(f"--map {text!r}: expected /ABSOLUTE/PREFIX=REPLACEMENT")
    return prefix.encode(), replacement.encode()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--map", type=parse_map, action="append", default=[], metavar="PREFIX=REPLACEMENT",
                    help="replace an absolute prefix (a checkout's root by nothing: --map /srv/ckout/=)")
    ap.add_argument("--pack", action="store_true", help=f"move the files --keep does not match into {ARCHIVE}")
    ap.add_argument("--keep", action="append", metavar="GLOB",
                    help="relative path glob of a file left out of the archive (default: '*', the top-level files)")
    args = ap.parse_args(argv)
    maps = args.map + [(str(ROOT).encode() + b"/", b"")]
    for folder in args.folders:
        if not folder.is_dir():
            ap.error(f"{folder}: not a folder")
        changed = 0
        for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != ARCHIVE):
            data = path.read_bytes()
            clean = scrub(data, maps)
            if clean != data:
                path.write_bytes(clean)
                changed += 1
        packed = pack(folder, args.keep or ["*"]) if args.pack else []
        print(f"{folder}: {changed} files rewritten, {len(packed)} packed into {ARCHIVE if packed else '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
