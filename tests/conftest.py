"""Suite-wide settings.

Hypothesis runs derandomized by default (profile "ci"): a fresh clone draws the same examples
every time, so CI cannot turn red without a code change. `HYPOTHESIS_PROFILE=dev` (make
test-random) explores new examples, as a developer should before landing a property.

PIPETTE_TEST_NO_TORCH=1 (make test-fast) makes importing torch or megatron an error, so the
planner's tiers stay runnable where only numpy is installed. Nothing here imports torch: tests
marked gpu import it when they are about to run, to skip themselves without CUDA.
"""

import importlib.abc
import os
import sys
import time
from collections.abc import Callable

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TORCH_PACKAGES = ("torch", "megatron")


class _NoTorch(importlib.abc.MetaPathFinder):
    """Fails any import of torch or megatron, naming the tier's rule."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in TORCH_PACKAGES:
            raise ModuleNotFoundError(f"{name} imported under PIPETTE_TEST_NO_TORCH=1 (the torch-free tier)",
                                      name=name)
        return None


if os.environ.get("PIPETTE_TEST_NO_TORCH") == "1":
    imported = sorted(m for m in sys.modules if m.partition(".")[0] in TORCH_PACKAGES)
    assert not imported, f"torch-free tier, but already imported: {imported[:5]}"
    sys.meta_path.insert(0, _NoTorch())


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")


@pytest.fixture(scope="session")
def forked() -> Callable[..., list[int]]:
    """`forked(target, [args, ...], timeout=120) -> exit codes`: one child per args tuple, forked
    from a fork server that imports torch and megatron-core once for the whole session (not from
    pytest itself, whose gloo and OpenMP threads a child could inherit with their locks held).
    Children report failures themselves (a file) and exit with os._exit."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["megatron_pipette.profile", "megatron.core.parallel_state"])

    def run(target: Callable, args_per_child: list[tuple], timeout: float = 120.0) -> list[int]:
        children = [ctx.Process(target=target, args=args) for args in args_per_child]
        for child in children:
            child.start()
        deadline = time.monotonic() + timeout
        for child in children:
            child.join(max(0.0, deadline - time.monotonic()))
        if any(child.is_alive() for child in children):
            for child in children:
                child.kill()
            pytest.fail(f"a forked child ran over {timeout} s")
        return [child.exitcode for child in children]

    return run
