"""The pre-launch phase exchanges its plan over gloo whatever the job's backend, so a peer that stops
answering makes a collective raise (and the hook fall back or stop with one line) instead of NCCL's
watchdog tearing the process down."""

from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_pipette.integration.start import control_group


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_control_group_is_gloo_whatever_the_backend(one_process_group):
    assert control_group("gloo", timedelta(seconds=5)) is None          # the default group already is
    group = control_group("nccl", timedelta(seconds=5))
    assert dist.get_backend(group) == "gloo"
    box = ["plan"]
    dist.broadcast_object_list(box, src=0, group=group)
    assert box == ["plan"]
