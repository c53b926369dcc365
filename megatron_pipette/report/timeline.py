"""A picture of one iteration: what every pipeline stage does, and when, under the chosen schedule.

Why: a breakdown table says how long the bubble is; a timeline shows where it is (the warmup, the
cooldown, a slow stage that the others wait for) and how interleaving fills it. The blocks come
from the event-driven simulator's trace of the critical data-parallel replica
(cost.timing.iteration_timeline), so the picture and the prediction are the same computation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_pipette.cost.timing import Timeline
from megatron_pipette.report.figures import DPI, figure, load_matplotlib, write_png

KINDS = ("forward", "backward", "recompute", "p2p", "bubble")
COLORS = {"forward": "#4c72b0", "backward": "#55a868", "recompute": "#dd8452", "p2p": "#c44e52",
          "bubble": "#e4e4e4"}
LEGEND = {"forward": "forward", "backward": "backward", "recompute": "recomputed forward",
          "p2p": "exposed p2p communication", "bubble": "bubble (waiting on another stage)"}
WIDTH_IN = 14.0
HEADER_IN = 1.9
"""Title, axis and legend."""
BOTTOM_IN, TOP_IN = 0.95, 0.65
"""Below the rows (axis, legend) and above them (the title)."""
ROW_IN = 0.45
MAX_ROWS_IN = 9.0
"""Rows share this height beyond 20 stages."""
LEFT, RIGHT = 0.07, 0.985
"""The axes' horizontal extent, as fractions of the figure's width."""
LABEL_PX = 14
"""A pass is labelled with its micro-batch when it is at least this wide."""
EDGE_PX = 4
"""A block is outlined when it is at least this wide (narrower ones would be all outline)."""


@dataclass(frozen=True, kw_only=True)
class Block:
    """One rectangle of the picture."""

    stage: int
    what: str
    """One of KINDS."""
    start_s: float
    end_s: float
    chunk: int | None = None
    microbatch: int | None = None


def size_in(stages: int) -> tuple[float, float]:
    """The picture's size in inches (DPI pixels an inch) for this many pipeline stages."""
    return WIDTH_IN, HEADER_IN + min(ROW_IN * stages, MAX_ROWS_IN)


def timeline_blocks(timeline: Timeline) -> list[Block]:
    """The simulator's events as the picture's blocks. A pass is one block, except that a backward
    starts with its recomputed forward (Megatron redoes each recomputed layer's forward just before
    that layer's backward; the picture gathers them at the front). A rank blocked in a p2p call
    waits on its peer (bubble) until the message starts moving, then on the transfer (exposed p2p);
    after its last op it idles (bubble) until the last stage ends the forward-backward pass."""
    blocks, ends = [], {}
    for e in timeline.events:
        start = e.start_s
        if e.what == "backward" and timeline.recompute_s[e.rank, e.chunk] > 0:
            start = e.start_s + float(timeline.recompute_s[e.rank, e.chunk])
            blocks.append(Block(stage=e.rank, what="recompute", start_s=e.start_s, end_s=start, chunk=e.chunk,
                                microbatch=e.microbatch))
        what = "bubble" if e.what == "wait" else e.what
        blocks.append(Block(stage=e.rank, what=what, start_s=start, end_s=e.end_s, chunk=e.chunk,
                            microbatch=e.microbatch))
        ends[e.rank] = max(ends.get(e.rank, 0.0), e.end_s)
    blocks += [Block(stage=r, what="bubble", start_s=end, end_s=timeline.pipeline_s)
               for r, end in sorted(ends.items()) if end < timeline.pipeline_s]
    return blocks


def write_timeline(timeline: Timeline, path: str | os.PathLike, title: str, flag: str = "--timeline") -> list[Block]:
    """Draw the timeline (a row per pipeline stage, stage 0 on top) with the predicted iteration time
    in the title, write it as a PNG and return the blocks drawn. Lighter passes belong to later
    model chunks; a hatched span after the pass is the rest of the iteration (gradient
    synchronisation, optimizer)."""
    load_matplotlib()
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch

    estimate, blocks = timeline.estimate, timeline_blocks(timeline)
    stages, chunks = timeline.recompute_s.shape
    width, height = size_in(stages)
    fig = figure(width, height)
    ax = fig.add_axes((LEFT, BOTTOM_IN / height, RIGHT - LEFT, 1 - (BOTTOM_IN + TOP_IN) / height))
    end = max(estimate.iteration_time_s, timeline.pipeline_s)
    px_per_s = (RIGHT - LEFT) * width * DPI / end
    for stage in range(stages):
        for what in KINDS:
            mine = [b for b in blocks if b.stage == stage and b.what == what]
            if not mine:
                continue
            fade = [1.0 if b.chunk is None or chunks == 1 else 1.0 - 0.5 * b.chunk / (chunks - 1) for b in mine]
            edges = ["white" if (b.end_s - b.start_s) * px_per_s >= EDGE_PX else "none" for b in mine]
            ax.broken_barh([(b.start_s, b.end_s - b.start_s) for b in mine], (stage - 0.4, 0.8),
                           facecolors=[to_rgba(COLORS[what], a) for a in fade], edgecolors=edges, linewidth=0.3)
    for b in blocks:
        if b.what in ("forward", "backward") and (b.end_s - b.start_s) * px_per_s >= LABEL_PX:
            ax.text((b.start_s + b.end_s) / 2, b.stage, str(b.microbatch), ha="center", va="center", fontsize=7,
                    color="white")
    tail = end - timeline.pipeline_s
    if tail > 0:
        ax.axvspan(timeline.pipeline_s, end, facecolor="none", edgecolor="#888888", hatch="//", linewidth=0)
    ax.set_xlim(0, end)
    ax.set_ylim(stages - 0.5, -0.5)
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("seconds into the iteration")
    handles = [Patch(facecolor=COLORS[k], label=LEGEND[k]) for k in KINDS if any(b.what == k for b in blocks)]
    if tail > 0:
        handles.append(Patch(facecolor="none", edgecolor="#888888", hatch="//",
                             label="gradient sync, optimizer"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=8)
    fig.suptitle(heading(timeline, title), fontsize=10)
    write_png(fig, path, flag)
    return blocks


def heading(timeline: Timeline, title: str) -> str:
    """The picture's title: `title`, then the schedule and the predicted iteration time."""
    chunks = timeline.recompute_s.shape[1]
    chunk_note = f", {chunks} model chunks a stage (lighter: later chunks)" if chunks > 1 else ""
    return (f"{title}\n{timeline.estimate.schedule} schedule, {timeline.microbatches} micro-batches{chunk_note}: "
            f"predicted {timeline.estimate.iteration_time_s:.3f} s/iteration (forward-backward "
            f"{timeline.pipeline_s:.3f} s)")

