"""Rows whose error the planner cannot know: the same inputs measured at different speeds by releases.

The planner prices a row from its model, cluster, precision, published layout, global batch and the
settings read from Megatron-Bridge 0.6.2's recipe. Rows of one table model and system whose inputs are
all equal get one price; when NVIDIA's releases measured them far apart, the difference is a setting
the releases changed that neither the published table nor the 0.6.2 recipe says (issue 31's example:
Qwen3-30B-A3B on 8 GB200 at one layout ran 26k tokens/s/GPU in 26.04.01 and 41k in 26.06). Such a
row's error beyond the bar is explained by that spread, and counted apart; every other row beyond
the bar stays unexplained.
"""

from __future__ import annotations

from benchmarks.validation.published_runs_h100 import WORST_BAR, layout_argv, model_argv, recipe_layout


def inputs(h100_row: dict) -> tuple[str, ...]:
    """Everything the planner reads of a row (in the H100 set's shape), as the flags it prices."""
    return (h100_row["label"].split(" ", 1)[1], *model_argv(h100_row, recipe=True),
            *layout_argv(recipe_layout(h100_row)))


def release_spread(h100_rows: list[dict], priced: list[dict]) -> list[str | None]:
    """For each priced row beyond WORST_BAR, why its error is not the model's where it is not: the
    same inputs' measured tokens/s/GPU over the set span more than WORST_BAR (their fastest over
    their slowest), named with the releases; None for the other rows."""
    groups: dict[tuple[str, ...], list[tuple[str, float]]] = {}
    for row in h100_rows:
        groups.setdefault(inputs(row), []).append((row["release"], row["tokens_per_s_per_gpu"]))
    out = []
    for row, result in zip(h100_rows, priced):
        error = result["recipe"].get("error")
        same = groups[inputs(row)]
        slow, fast = min(same, key=lambda rm: rm[1]), max(same, key=lambda rm: rm[1])
        if error is None or abs(error) <= WORST_BAR or fast[1] / slow[1] - 1 <= WORST_BAR:
            out.append(None)
            continue
        out.append(f"the same inputs measured {slow[1]:,} tokens/s/GPU in {slow[0]} and {fast[1]:,} in {fast[0]} "
                   f"({fast[1] / slow[1] - 1:+.0%}): a setting the releases changed that the table and the "
                   "0.6.2 recipe do not say")
    return out
