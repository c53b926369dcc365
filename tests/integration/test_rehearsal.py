"""enable_cpu_rehearsal() redirects CUDA use to the CPU. It patches torch for good, so the
checks run in a child: a fork of the session's fork server (tests/conftest.py, `forked`), which
has imported torch and megatron-core already."""

import os
import traceback
from pathlib import Path

import pytest


def _checks(out: str) -> None:
    """Write "ok" to `out` when every check holds, else the traceback to `out`.err."""
    code = 0
    try:
        import torch

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
        Path(out).write_text("ok")
    except BaseException:  # noqa: BLE001 - report anything to the parent, then exit non-zero
        Path(out + ".err").write_text(traceback.format_exc())
        code = 1
    os._exit(code)  # skip the fork server's exit handlers


@pytest.mark.torchrun
def test_redirects(forked, tmp_path: Path) -> None:
    out = tmp_path / "checks"
    assert forked(_checks, [(str(out),)]) == [0], Path(f"{out}.err").read_text()[-3000:]
    assert out.read_text() == "ok"
