"""Run Megatron's real argument handling with --auto-parallel, then report the groups it builds.

Launched under torchrun by test_autoparallel.py. Prints one line per process:
`GROUPS {"physical": torchrun rank, "tp": [...], "pp": [...], "dp": [...]}` with the
members of this process's Megatron groups given as their original torchrun ranks.
With PIPETTE_TEST_FAIL_PROBE_RANK=r, rank r's probe raises before its first message.
With PIPETTE_TEST_CRASH_FIRST_ATTEMPT=1, rank 0 crashes after reporting in torchrun's first
attempt, so that torchrun restarts the whole worker group (an elastic restart).
With PIPETTE_TEST_STOP_RANK=r, rank r stops itself (SIGSTOP: hung, not dead) while rank 0 profiles,
and every process prints when it exits.
With PIPETTE_TEST_MIN_WAIT_S=s, the hook's pre-launch waits time out after s seconds at least
(instead of MIN_WAIT_S), so a test that waits out a failed rank waits less.
"""

import json
import os
import sys

physical = int(os.environ["RANK"])  # torchrun's rank, before the hook renumbers the processes

from megatron_pipette.integration.rehearsal import enable_cpu_rehearsal  # noqa: E402

enable_cpu_rehearsal()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402

from megatron_pipette.integration.install import install  # noqa: E402

install()  # what the .pth does on import; explicit here so the test does not depend on site-packages

if "PIPETTE_TEST_MIN_WAIT_S" in os.environ:
    from megatron_pipette.integration import start

    start.MIN_WAIT_S = float(os.environ["PIPETTE_TEST_MIN_WAIT_S"])

if os.environ.get("PIPETTE_TEST_FAIL_PROBE_RANK") == str(physical):
    from megatron_pipette.probe import runner

    def broken_probe(*args, **kwargs):
        raise RuntimeError(f"injected probe failure on rank {physical}")

    runner.run_probe = broken_probe

if os.environ.get("PIPETTE_TEST_STOP_RANK") == str(physical):
    import signal
    import subprocess
    import time

    from megatron.core import parallel_state as state

    set_up = state.initialize_model_parallel

    def stop_after_setup(*args, **kwargs):
        """The hook sets up a neutral model-parallel state for rank 0's profile: stop there. Continued
        after 40 s, past the others' bound, so that torchrun's SIGTERM ends it without its 30 s wait."""
        set_up(*args, **kwargs)
        print(f"STOPPED {physical} {time.time()}", flush=True)
        subprocess.Popen(["sh", "-c", f"sleep 40; kill -CONT {os.getpid()}"], start_new_session=True)
        os.kill(os.getpid(), signal.SIGSTOP)

    state.initialize_model_parallel = stop_after_setup

if "PIPETTE_TEST_STOP_RANK" in os.environ:
    import atexit
    import time

    atexit.register(lambda: print(f"EXITED {physical} {time.time()}", flush=True))

args = parse_and_validate_args()
parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)


def members(group) -> list[int]:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, physical, group=group)
    return sorted(out)


report = {"physical": physical, "rank": dist.get_rank(),
          "tp": members(parallel_state.get_tensor_model_parallel_group()),
          "pp": members(parallel_state.get_pipeline_model_parallel_group()),
          "dp": members(parallel_state.get_data_parallel_group()),
          "layout": [args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size]}
print("GROUPS " + json.dumps(report), flush=True)
dist.barrier()
if (os.environ.get("PIPETTE_TEST_CRASH_FIRST_ATTEMPT") == "1" and physical == 0
        and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"):
    os._exit(17)
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
sys.exit(0)
