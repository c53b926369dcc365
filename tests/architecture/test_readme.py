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
