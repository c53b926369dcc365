"""Where the CLI's output goes wrong (issue 33): a closed pipe ends it quietly, a full disk in one line,
and a notebook's or a misspelt MPLBACKEND does not stop a --timeline picture. Each runs `pipette` as a
child interpreter, since what is tested is its standard output and its exit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torchrun

TINY = ["plan", "--model", "tiny-gpt", "--num-nodes", "1", "--gpus-per-node", "2", "--top", "1"]


def pipette(argv: list[str], stdout, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_pipette", *argv], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_a_closed_pipe_ends_quietly() -> None:
    """`pipette plan | head -1`: the reader is gone before anything is written (its end of the pipe is
    closed before pipette starts, so every write fails with EPIPE), and the CLI stops without a
    traceback, with Python's status for EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = pipette([*TINY, "--json"], stdout=write_end)
    finally:
        os.close(write_end)
    assert done.stderr == "" and done.returncode == 1


def test_a_full_disk_is_one_line() -> None:
    with open("/dev/full", "w") as full:
        done = pipette([*TINY, "--json"], stdout=full)
    assert done.returncode == 1
    assert done.stderr == "pipette plan: error: cannot write the output: No space left on device\n"


@pytest.mark.parametrize("backend", ["module://matplotlib_inline.backend_inline", "no-such-backend"])
def test_a_timeline_is_written_whatever_mplbackend_says(tmp_path: Path, backend: str) -> None:
    """A notebook's backend (outside the notebook, or not installed) or a misspelt one made matplotlib's
    import raise; the picture is drawn on the Agg canvas and never needed it."""
    picture = tmp_path / "timeline.png"
    done = pipette([*TINY, "--timeline", str(picture)], stdout=subprocess.PIPE, env={"MPLBACKEND": backend})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert picture.read_bytes().startswith(b"\x89PNG")
