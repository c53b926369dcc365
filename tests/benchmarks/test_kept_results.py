"""The development sets' kept results are what the code prices today. The README's table and
docs/validation.md quote benchmarks/results/ (validation_summary.py --check holds the README to
them); these tests price both sets again, so a change that moves a published run's prediction (a
fitted constant, a memory term) fails here, naming the rows that moved and the command that keeps
new results."""

import json
from pathlib import Path

import pytest

from benchmarks.validation import published_runs as a100
from benchmarks.validation import published_runs_blackwell as blackwell
from benchmarks.validation import published_runs_h100 as h100
from benchmarks.validation import summary as validation_summary

ROOT = Path(__file__).resolve().parents[2]

RELATIVE = 1e-3
"""A predicted time or peak memory may move by 0.1% before the kept figure counts as stale."""
ABSOLUTE = 1e-3
"""The summaries' error fractions may move by 0.1 percentage point (the README's last digit)."""


def kept(folder: str) -> dict:
    return json.loads((validation_summary.RESULTS / folder / "results.json").read_text())


def drift(name: str, was, now, relative: bool = True) -> list[str]:
    """Nothing where `now` is `was` within the tolerance, else a line saying how it moved. Counts,
    flags, layouts and a figure present on one side only must match exactly."""
    if isinstance(was, float) and isinstance(now, float):
        off = abs(now / was - 1) if relative else abs(now - was)
        if off <= (RELATIVE if relative else ABSOLUTE):
            return []
        return [f"{name}: kept {was:.4f}, now {now:.4f} ({now / was - 1:+.2%})" if relative else
                f"{name}: kept {was:+.2%}, now {now:+.2%}"]
    return [] if was == now else [f"{name}: kept {was!r}, now {now!r}"]


def stale(folder: str, moved: list[str], command: str) -> str:
    return (f"{len(moved)} figures moved from benchmarks/results/{folder} (tolerance {RELATIVE:.1%} of a time "
            f"or memory, {ABSOLUTE * 100:.1f} percentage point of an error figure):\n  " + "\n  ".join(moved) +
            f"\nKeep new results: python -m benchmarks.validation.{command} "
            f"--out benchmarks/results/<name>-<date>-<change>, point "
            f"benchmarks/validation/summary.py at the folder, run `python -m benchmarks.validation.summary` for "
            f"the README's table, and update docs/validation.md")


def summary_drift(was: dict, now: dict, where: str, keys) -> list[str]:
    return [line for k in keys for line in drift(f"{where} {k}", was[k], now[k], relative=False)]


H100_ERRORS = ("mean_abs_error", "mean_error", "worst_error")
H100_COUNTS = ("runs", "priced", "beyond_25pct", "predicted_not_to_fit", "fits_within_2pct")


def test_h100_development_set_prices_as_kept_at_its_published_layouts():
    """Every row's predicted time and peak memory at the published layout, without and with its
    recipe, and the summary figures those give (the free search: the slow test below)."""
    results = kept(validation_summary.H100_FOLDER)
    rows = [h100.result_row(row, search=False) for row in json.loads(h100.DATA.read_text())["rows"]]
    was = {r["id"]: r for r in results["rows"]}
    moved = drift("rows", sorted(was), sorted(r["id"] for r in rows))
    for row in (r for r in rows if r["id"] in was):
        for key in ("plain", "recipe"):
            for figure in ("predicted_s", "peak_gib", "fits", "error_message"):
                moved += drift(f"{row['id']} {key} {figure}", was[row["id"]][key].get(figure), row[key].get(figure))
    for key in ("plain", "recipe"):
        now = h100.summary(rows, key)
        moved += summary_drift(results["summary"][key], now, f"summary {key}", H100_ERRORS + H100_COUNTS)
    assert not moved, stale(validation_summary.H100_FOLDER, moved, "published_runs_h100")


@pytest.mark.slow
def test_h100_development_sets_free_search_picks_as_kept():
    """The free search's pick for every row (and, for the MoE rows, at the published micro-batch
    size) and the median MoE gain the README quotes; about 2-4 minutes of search on 2 cores."""
    results = kept(validation_summary.H100_FOLDER)
    rows = [h100.result_row(row, search=True) for row in json.loads(h100.DATA.read_text())["rows"]]
    was = {r["id"]: r["search"] for r in results["rows"]}
    moved = []
    for row in rows:
        search, kept_search = row["search"], was.get(row["id"], {})
        moved += drift(f"{row['id']} search_s", kept_search.get("search_s"), search.get("search_s"))
        moved += drift(f"{row['id']} at its micro-batch size search_s",
                       kept_search.get("at_published_mbs", {}).get("search_s"),
                       search.get("at_published_mbs", {}).get("search_s"))
    for key in ("plain", "recipe"):
        moved += summary_drift(results["summary"][key], h100.summary(rows, key), f"summary {key}",
                               ("moe_median_search_gain", "moe_median_search_gain_at_published_mbs"))
    assert not moved, stale(validation_summary.H100_FOLDER, moved, "published_runs_h100")


def test_a100_runs_price_as_kept():
    """Every run's predicted time, layout and fit, and the development, held-out and whole sets'
    summaries."""
    results = kept(validation_summary.A100_FOLDER)
    runs = json.loads(a100.DATA.read_text())["runs"]
    sets = a100.split([r["id"] for r in runs])
    rows = [a100.result_row(run, sets) for run in runs]
    was = {r["id"]: r for r in results["runs"]}
    moved = drift("runs", sorted(was), sorted(r["id"] for r in rows))
    for row in (r for r in rows if r["id"] in was):
        for figure in ("set", "predicted_s", "peak_gib", "layout", "fits"):
            moved += drift(f"{row['id']} {figure}", was[row["id"]][figure], row[figure])
    for name in ("dev", "held-out", "all"):
        moved += summary_drift(results["summary"][name], a100.summary(rows, name), f"summary {name}",
                               ("runs", "within_15pct", "mean_abs_error", "worst_error", "mean_error"))
    assert not moved, stale(validation_summary.A100_FOLDER, moved, "published_runs")


def test_blackwell_development_set_prices_as_kept():
    """Every row's predicted time, peak memory, fit and refusals at the published layout, without and
    with its recipe, the summaries and the refusal counts (about 10 s on one core)."""
    results = kept(validation_summary.BLACKWELL_FOLDER)
    rows = [blackwell.priced_row(row, search=False) for row in json.loads(blackwell.DATA.read_text())["rows"]]
    was = {r["id"]: r for r in results["rows"]}
    moved = drift("rows", sorted(was), sorted(r["id"] for r in rows))
    for row in (r for r in rows if r["id"] in was):
        moved += drift(f"{row['id']} refused", was[row["id"]]["refused"], row["refused"])
        for key in ("plain", "recipe"):
            for figure in ("predicted_s", "peak_gib", "fits", "error_message"):
                moved += drift(f"{row['id']} {key} {figure}", was[row["id"]][key].get(figure), row[key].get(figure))
    for key in ("plain", "recipe"):
        moved += summary_drift(results["summary"][key], h100.summary(rows, key), f"summary {key}",
                               H100_ERRORS + H100_COUNTS)
    moved += drift("refusals", results["refusals"], blackwell.refusal_counts(rows))
    assert not moved, stale(validation_summary.BLACKWELL_FOLDER, moved, "published_runs_blackwell")
