"""Profiling inside a running Megatron job: rank 0 of a TP-2 job (two gloo processes).

The ranks are children of the session's fork server (tests/conftest.py, `forked`),
which imports torch and megatron-core once: no interpreter start-up per rank.
"""

import json
import os
import traceback
from datetime import timedelta

import pytest
import torch

from helpers.processes import free_port
from megatron_pipette.spec.layer_profile import profile_from_json
from megatron_pipette.spec.workload import Workload

WORKLOAD = Workload(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, global_batch_size=8,
                    vocab_size=1000, precision="fp32")


def _rank(rank: int, port: int, tmp: str) -> None:
    """A TP-2 job's rank; rank 0 profiles mid-job, then both use the job's TP group."""
    code = 0
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state

        from megatron_pipette.profile import profile_layers

        store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        parallel_state.initialize_model_parallel(2, 1)
        result: dict = {}
        if rank == 0:
            result["doc"] = profile_layers(WORKLOAD, tp_sizes=(1, 2), micro_batch_sizes=(1,), recompute=(None,),
                                           sequence_parallel=(False,), device="cpu", warmup=0, iters=1).to_json()
            result["tp_after"] = parallel_state.get_tensor_model_parallel_world_size()
        dist.barrier()
        t = torch.ones(1)
        dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group())
        result["all_reduce"] = t.item()
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    except BaseException:  # noqa: BLE001 - report anything to the parent, then exit non-zero
        with open(os.path.join(tmp, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        code = 1
    os._exit(code)  # skip the forked pytest's exit handlers


@pytest.mark.torchrun
def test_rank_zero_of_a_tp2_job_profiles_with_its_own_groups(forked, tmp_path):
    port = free_port()
    exit_codes = forked(_rank, [(r, port, str(tmp_path)) for r in range(2)])
    errors = [e.read_text() for e in tmp_path.glob("rank*.err")]
    assert not errors and exit_codes == [0, 0], "\n".join(errors)[-3000:]
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["tp_after"] == 2 and result["all_reduce"] == 2.0
    profile = profile_from_json(result["doc"])
    # The per-rank bytes of a standalone profile: TP 2 halves heads and FFN on one-rank groups.
    assert profile.layer(1, 1, False, None).activation_bytes == 197120
    assert profile.layer(2, 1, False, None).activation_bytes == 123392
