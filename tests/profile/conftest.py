"""Shared settings for the profiler tests.

One intra-op thread: with two threads on a loaded two-core machine a parallel op
waits whenever the scheduler parks its second thread, single iterations then take
100x longer and timing comparisons turn to noise. One thread measures the same
work steadily.

megatron-core's import-time and deprecation warnings (no Apex, no TE, tp_group
defaults) are not about this code; they are silenced for these tests only.
"""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.fspath).parents:
            for category in ("UserWarning", "DeprecationWarning", "FutureWarning"):
                item.add_marker(pytest.mark.filterwarnings(f"ignore::{category}:megatron"))


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
