"""enable_cpu_rehearsal() redirects CUDA use to the CPU (in a child: it patches torch globally)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHECKS = """
import os, torch
from megatron_pipette.integration.rehearsal import enable_cpu_rehearsal, is_enabled
assert not is_enabled()
enable_cpu_rehearsal()
enable_cpu_rehearsal()  # idempotent
assert is_enabled() and os.environ["PIPETTE_CPU_REHEARSAL"] == "1"
assert torch.zeros(2, device="cuda").device.type == "cpu"
assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
x = torch.ones(3)
assert x.cuda() is x
assert x.type() == "torch.cuda.FloatTensor" and x.long().type() == "torch.LongTensor"
assert x.type(torch.float64).dtype == torch.float64
state = torch.cuda.get_rng_state()
torch.cuda.manual_seed(1)
torch.cuda.set_rng_state(state)
assert torch.equal(torch.cuda.get_rng_state(), state)

from megatron.core.tensor_parallel import random as tp_random
tracker = tp_random.get_cuda_rng_tracker()
tracker.add("a", 123)
with tracker.fork("a"):
    first = torch.rand(2)
with tracker.fork("a"):
    second = torch.rand(2)
torch.manual_seed(123)
assert torch.equal(first, torch.rand(2)) and not torch.equal(first, second)
print("ok")
"""


@pytest.mark.torchrun
def test_redirects() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHECKS], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
