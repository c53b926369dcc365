"""benchmarks/results/ holds only what something cites: a doc, the package (its docstrings and data
sources), a benchmark or a test names every folder there; what nothing names any more lives in
benchmarks/archive/. Every folder a doc names is kept in one of the two."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
ARCHIVE = ROOT / "benchmarks" / "archive"
FOLDER = re.compile(r"(?<![\w#-])([a-z0-9_]+(?:-[a-z0-9_]+)*-20\d\d-\d\d-\d\d(?:-[a-z0-9_]+)*)(?![\w-])")
"""A results folder's name: BENCHMARK-DATE[-variant]."""


def citing_texts() -> dict[str, str]:
    """Every README, doc, package, benchmark and test file, the kept results themselves excluded."""
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    for top, suffixes in (("megatron_pipette", (".py", ".json")), ("benchmarks", (".py", ".md", ".sh")),
                          ("tests", (".py",))):
        files += [p for p in (ROOT / top).rglob("*") if p.suffix in suffixes
                  and RESULTS not in p.parents and ARCHIVE not in p.parents and p != Path(__file__).resolve()]
    return {p.relative_to(ROOT).as_posix(): p.read_text(errors="replace") for p in sorted(files)}


def test_every_kept_folder_is_cited():
    cited = {name for text in citing_texts().values() for name in FOLDER.findall(text)}
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.is_dir() and p.name not in cited)
    assert not uncited, ("folders under benchmarks/results/ that no doc, code or test names; cite them or "
                         "`git mv` them to benchmarks/archive/: " + ", ".join(uncited))


def test_every_folder_a_doc_names_is_kept():
    kept = {p.name for folder in (RESULTS, ARCHIVE) for p in folder.iterdir() if p.is_dir()}
    docs = {name: text for name, text in citing_texts().items() if name.endswith(".md")}
    missing = sorted({f"{doc}: {folder}" for doc, text in docs.items() for folder in FOLDER.findall(text)
                      if folder not in kept})
    assert not missing, "docs name results folders that are kept nowhere:\n" + "\n".join(missing)
