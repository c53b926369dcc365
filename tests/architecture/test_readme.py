"""The README's validation table is the one benchmarks/validation/summary.py generates from the kept
results, and every file the README and docs link to exists."""

import re
from pathlib import Path

from benchmarks.validation import summary as validation_summary

ROOT = Path(__file__).resolve().parents[2]


def test_readme_validation_table_is_generated_from_kept_results():
    assert validation_summary.readme_table((ROOT / "README.md").read_text()) == validation_summary.table()


def test_links_of_readme_and_docs_exist():
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {target}")
    assert missing == []


def test_every_benchmark_command_the_docs_quote_is_a_module():
    """The docs quote benchmarks as `python -m benchmarks.PACKAGE.MODULE` and name their files: each exists."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
    quoted = {(doc.relative_to(ROOT).as_posix(), module) for doc in texts if "results" not in doc.parts
              for module in re.findall(r"python[0-9.]* -m (benchmarks(?:\.\w+)+)", doc.read_text())}
    assert quoted, "no benchmark command quoted"
    missing = sorted(f"{doc}: {module}" for doc, module in quoted
                     if not (ROOT / (module.replace(".", "/") + ".py")).is_file()
                     and not (ROOT / module.replace(".", "/") / "__main__.py").is_file())
    missing += sorted(f"{doc.relative_to(ROOT)}: {path}" for doc in texts if "results" not in doc.parts
                      for path in re.findall(r"(?<![\w/])(benchmarks/[\w/]+\.(?:py|sh|json))", doc.read_text())
                      if not (ROOT / path).is_file())
    assert missing == []
    stale = sorted(f"{doc.relative_to(ROOT)}: {path}" for doc in texts if "results" not in doc.parts
                   for path in re.findall(r"python[0-9.]* (benchmarks/\S+\.py)", doc.read_text()))
    assert stale == [], "run benchmarks as modules (python -m benchmarks....), not as files"
