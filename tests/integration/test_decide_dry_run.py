"""A dry run whose planning failed: it stops non-zero saying so, where a training start falls back to the
flags as given (in one process, the collectives of planning replaced by the failure they end in)."""

from argparse import Namespace
from datetime import timedelta

import pytest
import torch.distributed as dist

from helpers.megatron_args import megatron_namespace
from megatron_pipette.errors import PipetteError
from megatron_pipette.integration import decide
from megatron_pipette.integration.common import Phases
from megatron_pipette.integration.start import Started


def started() -> Started:
    return Started(store=dist.HashStore(), rank=0, world=1, backend="gloo", timeout=timedelta(seconds=5),
                   user_timeout=timedelta(minutes=10), attempt="0", phases=Phases(budget_s=60.0))


def options(**kw) -> Namespace:
    return Namespace(**{"auto_parallel_budget_s": 60.0, "auto_parallel_strict": False,
                        "auto_parallel_dry_run": False, **kw})


@pytest.fixture
def planning_fails(monkeypatch):
    def fail(*_):
        raise PipetteError("injected probe failure")

    monkeypatch.setattr(decide, "_on_rank0_then_broadcast", lambda work, rank, group: None)
    monkeypatch.setattr(decide, "_plan", fail)


def test_a_dry_run_whose_planning_failed_exits_non_zero_saying_so(planning_fails, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        decide.decide(started(), megatron_namespace(), [], options(auto_parallel_dry_run=True))
    out = capsys.readouterr()
    assert stopped.value.code == 1 and out.err == ("auto-parallel failed (--auto-parallel-dry-run): planning failed "
                                                   "(rank 0: injected probe failure); no plan to print, nothing "
                                                   "trained\n")
    assert "training with the flags as given" not in out.out


def test_a_training_start_whose_planning_failed_falls_back(planning_fails, capsys) -> None:
    chosen = decide.decide(started(), megatron_namespace(), [], options())
    assert chosen.plan is None and chosen.fallback is not None
    assert "WARNING: planning failed (rank 0: injected probe failure); training with the flags as given" in \
        capsys.readouterr().out
