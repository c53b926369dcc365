"""Rows whose error the planner cannot know: settings a release changed that nothing published says.

The planner prices a row from its model, cluster, precision, published layout, global batch and the
settings read from Megatron-Bridge 0.6.2's recipe. Three kinds of evidence say that a row ran with
settings other than those, and so explain its error beyond the bar:
- a release step: rows of one table model and system whose inputs are all equal get one price, and
  NVIDIA's releases measured them far apart (issue 31's example: Qwen3-30B-A3B on 8 GB200 at one
  layout ran 26k tokens/s/GPU in 26.04.01 and 41k in 26.06). The spread is measured, so this shows
  that the difference is in settings the planner is not given.
- a release step on another system (weaker, counted apart): the row has no later measurement of its
  own inputs, but the same run (model, precision, layout, global batch, GPU count) of the same release
  on another system was measured again by a later release more than 25% apart, in the direction of
  the row's error (a slower row priced too fast: the later release faster). The recipes are written
  per system but change release by release across all of them (0.6.2's MoE recipes share one
  full-iteration CUDA-graph stack, perf_recipes/qwen/common.py), so the step says the row's release ran
  settings the later recipe changed; it does not measure this system's step.
- another recipe: the run's layout (or GPU count) is not the one 0.6.2's recipe sets, so the run came
  from another release's recipe, whose other settings 0.6.2 does not have. This is weaker: it shows
  that the settings are unknown, not that they make the difference.
Every other row beyond the bar stays unexplained, and the summary counts each kind apart. A published
layout predicted not to fit is explained only by another recipe (a release step says nothing of memory).
"""

from __future__ import annotations

import re

from benchmarks.validation.published_runs_h100 import WORST_BAR, launch_argv

RELEASE_STEP, STEP_ELSEWHERE, ANOTHER_RECIPE = "release step", "release step elsewhere", "another recipe"


def inputs(h100_row: dict) -> tuple[str, ...]:
    """Everything the planner reads of a row (in the H100 set's shape, which published_runs_blackwell
    prices), as the flags it prices."""
    return (h100_row["label"].split(" ", 1)[1], *launch_argv(h100_row, recipe=True))


def run_and_recipe(row: dict) -> tuple[dict, dict]:
    """The run's GPU count and layout, and those of the 0.6.2 recipe read for it (`recipe.layout`,
    the count in its function's name), EP unset read as 1, and the recipe's VP unset as 1; a VP the
    table does not print stays None, not a difference (the pricing takes the recipe's there)."""
    recipe, published = row["recipe"], row["published_layout"]
    count = re.search(r"_(\d+)gpu_", recipe.get("function") or "")
    given = recipe.get("layout", {})
    run = {"GPUs": row["gpus"], "TP": published["tp"], "PP": published["pp"], "CP": published["cp"],
           "VP": published["virtual_stages_per_pipeline_rank"], "EP": published["ep"] or 1,
           "MBS": published["micro_batch_size"], "GBS": row["global_batch_size"]}
    read = {**{key: given.get(key) for key in run}, "GPUs": int(count.group(1)) if count else None,
            "VP": given.get("VP") or 1, "EP": given.get("EP") or 1}
    return run, read


def release(row: dict) -> tuple[int, ...]:
    """A release's name as numbers, in time order (26.04.01 after 26.04)."""
    return tuple(int(part) for part in row["release"].split("."))


def same_run(row: dict) -> tuple:
    """What makes two systems' rows the same run: model, precision, published layout, batch, GPUs."""
    return row["label"].split()[1], row["precision"], tuple(sorted(run_and_recipe(row)[0].items()))


def step_elsewhere(row: dict, error: float, rows: list[dict], keys: list[tuple]) -> str | None:
    """Why, where the same run of this row's release on another system was measured again by a later
    release beyond WORST_BAR in the direction of `error`, and this row's inputs were not measured in
    that release or after (the module docstring), else None."""
    key = dict(zip(map(id, rows), keys))
    own = max((release(other) for other in rows if key[id(other)] == key[id(row)]), default=release(row))
    run = same_run(row)
    for before in rows:
        if before["system"] == row["system"] or release(before) != release(row) or same_run(before) != run:
            continue
        for after in rows:
            step = after["tokens_per_s_per_gpu"] / before["tokens_per_s_per_gpu"] - 1
            if (key[id(after)] == key[id(before)] and release(after) > own and abs(step) > WORST_BAR
                    and (step > 0) == (error < 0)):
                return (f"the same run on {before['system']} measured {before['tokens_per_s_per_gpu']:,} "
                        f"tokens/s/GPU in {before['release']} and {after['tokens_per_s_per_gpu']:,} in "
                        f"{after['release']} ({step:+.0%}), after this system last ran these inputs: a setting the "
                        "releases changed that the table and the 0.6.2 recipe do not say")
    return None


def explanations(rows: list[dict], h100_rows: list[dict], priced: list[dict]) -> list[tuple[str, str] | None]:
    """For each of the set's rows priced (`priced`, from `h100_rows`, the rows in the H100 set's shape)
    beyond WORST_BAR, (kind, why) where a release step or another recipe explains its error (the
    module docstring), in the docstring's order; for a row within it predicted not to fit, where another
    recipe does; None for the other rows."""
    keys = [inputs(row) for row in h100_rows]
    groups: dict[tuple[str, ...], list[tuple[str, float]]] = {}
    for row, key in zip(rows, keys):
        groups.setdefault(key, []).append((row["release"], row["tokens_per_s_per_gpu"]))
    out = []
    for row, key, result in zip(rows, keys, priced):
        error = result["recipe"].get("error")
        beyond = error is not None and abs(error) > WORST_BAR
        if not beyond and (error is None or result["recipe"]["fits"]):
            out.append(None)
            continue
        same = groups[key]
        slow, fast = min(same, key=lambda rm: rm[1]), max(same, key=lambda rm: rm[1])
        run, read = run_and_recipe(row)
        differs = [name for name in run if run[name] is not None and read[name] != run[name]]
        if beyond and fast[1] / slow[1] - 1 > WORST_BAR:
            out.append((RELEASE_STEP, f"the same inputs measured {slow[1]:,} tokens/s/GPU in {slow[0]} and "
                        f"{fast[1]:,} in {fast[0]} ({fast[1] / slow[1] - 1:+.0%}): a setting the releases changed "
                        "that the table and the 0.6.2 recipe do not say"))
        elif beyond and (why := step_elsewhere(row, error, rows, keys)):
            out.append((STEP_ELSEWHERE, why))
        elif row["recipe"].get("function") and differs:
            out.append((ANOTHER_RECIPE, "the run's " + ", ".join(f"{k} {run[k]}" for k in differs) + " where 0.6.2's "
                        "recipe has " + ", ".join(f"{k} {read[k]}" for k in differs) + f": the {row['release']} "
                        "recipe is not 0.6.2's, and its other settings are not known"))
        else:
            out.append(None)
    return out
