"""Launch multi-process jobs from tests, bounded in time: a hung rank must not hang the suite.

The launchers are session fixtures, so module fixtures can share one launch among tests."""

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run_bounded(cmd: list[str], timeout: float = 240, expect_failure: bool = False) -> str:
    """Run `cmd` in its own process group; return its output, fail on timeout and on an error
    (on success instead, with expect_failure)."""
    # One thread per rank (the ranks share the cores); the interpreter the tests run under.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "PYTHON": sys.executable,
    }
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[:3]} timed out after {timeout} s:\n{out[-5000:]}")
    if (proc.returncode != 0) != expect_failure:
        pytest.fail(f"{cmd[:3]} exited with {proc.returncode}:\n{out[-5000:]}")
    return out


def _run_torchrun(script: Path, args: list[str], nproc: int = 4, timeout: float = 240,
                  expect_failure: bool = False) -> str:
    """Run `script` under torchrun --standalone (a free port) with `nproc` processes."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(script), *args,
    ]
    return _run_bounded(cmd, timeout, expect_failure)


@pytest.fixture(scope="session")
def run_bounded() -> Callable[..., str]:
    """`run_bounded(cmd, timeout=240, expect_failure=False) -> output`."""
    return _run_bounded


@pytest.fixture(scope="session")
def run_torchrun() -> Callable[..., str]:
    """`run_torchrun(script, args, nproc=4, timeout=240, expect_failure=False) -> output`."""
    return _run_torchrun
