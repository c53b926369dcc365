"""The timeline pictures' captions say what the commands they quote draw today: stages, model
chunks a stage, micro-batches and predicted seconds, as the planner returns them to the picture
(not the picture's bytes; a stale picture is redrawn by its caption's command)."""

import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from megatron_pipette.cli.main import main
from megatron_pipette.report import timeline as timeline_picture

ROOT = Path(__file__).resolve().parents[2]
COMMAND = r"`(?P<command>pipette plan [^`]*--timeline (?P<png>docs/[\w.-]+\.png))`"
CAPTIONS = [
    ("README.md", COMMAND + r" \((?P<stages>\d+) stages, (?P<chunks>\d+) interleaved chunks each, "
                            r"(?P<seconds>[0-9.]+) s an iteration;", {}),
    ("docs/cli.md", r"runs no pipeline: its (?P<microbatches>\d+) micro-batches go back to back, "
                    r"(?P<seconds>[0-9.]+) s an iteration \(" + COMMAND, {"stages": 1, "chunks": 1}),
    ("docs/cli.md", r"interleaves (?P<chunks>\d+) model chunks on each of (?P<stages>\d+) stages, "
                    r"(?P<seconds>[0-9.]+) s an iteration \(" + COMMAND, {}),
]
"""Each caption's document, its pattern, and what its words say without a number ("no pipeline")."""


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """What a command would draw: the timeline the planner hands to the picture, not drawn (each
    command planned once)."""
    folder = tmp_path_factory.mktemp("timeline")

    @cache
    def plan(command: str) -> dict:
        words = shlex.split(command)
        at = words.index("--timeline") + 1
        words[at] = str(folder / Path(words[at]).name)
        seen = []
        with pytest.MonkeyPatch.context() as patch:
            patch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)   # the plan's overheads read it
            patch.setattr(timeline_picture, "write_timeline", lambda timeline, *_, **__: seen.append(timeline))
            assert main(words[1:]) == 0
        (timeline,) = seen
        stages, chunks = timeline.recompute_s.shape
        return {"stages": stages, "chunks": chunks, "microbatches": timeline.microbatches,
                "seconds": f"{timeline.estimate.iteration_time_s:.2f}"}
    return plan


@pytest.mark.parametrize(("document", "pattern", "implied"), CAPTIONS,
                         ids=["README.md", "cli.md-13b", "cli.md-175b"])
def test_timeline_caption_is_what_its_command_draws(document, pattern, implied, drawn):
    text = " ".join((ROOT / document).read_text().split())
    match = re.search(pattern, text)
    assert match, f"{document}: no caption matching {pattern}"
    said = {**{k: str(v) for k, v in implied.items()},
            **{k: v for k, v in match.groupdict().items() if k not in ("command", "png") and v is not None}}
    assert (ROOT / match["png"]).exists()
    got = drawn(match["command"])
    assert said == {k: str(got[k]) for k in said}, (
        f"{document}'s caption is stale: run `{match['command']}` (PYTORCH_CUDA_ALLOC_CONF unset) and write "
        f"its figures {got} into the caption")
