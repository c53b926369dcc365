"""Where a benchmark keeps its raw results: `--out FOLDER`'s results.json, the file every published
figure is read from (docs/extending.md, section 7)."""

from __future__ import annotations

import json
from pathlib import Path


def keep(folder: str | Path, result: dict) -> Path:
    """Write `result` as FOLDER/results.json (the folder made if need be); the folder."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    return out
