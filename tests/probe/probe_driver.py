"""Test-only torchrun entry point: run_probe on gloo, every rank dumps what it returned (None off rank 0).

Usage: torchrun ... probe_driver.py OUT_DIR JSON_KWARGS

PIPETTE_PROBE_TEST_SLOW_RANK=<rank> slows that rank *from the outside*, the
way a throttled or shared device is slow: before calling the probe, the
rank pins its main thread (and threads it starts later) to one CPU, lowers
its priority and starts a pure-Python busy thread that competes with it for
that CPU and for the GIL. PIPETTE_PROBE_TEST_STUCK_RANK=<rank> makes that rank
never call the probe (with PIPETTE_PROBE_TEST_TIMEOUT_S as the group's
timeout). PIPETTE_PROBE_TEST_DIE_RANK=<rank> makes that rank exit abruptly
PIPETTE_PROBE_TEST_DIE_AFTER_S seconds into the probe, mid-round. Nothing in
megatron_pipette knows about these variables.
"""

import json
import os
import sys
import threading
import time


def _slow_down_this_process() -> None:
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})      # the calling thread; threads started later inherit it
    os.nice(19)

    def spin() -> None:
        while True:
            pass

    threading.Thread(target=spin, daemon=True).start()


def main() -> None:
    out_dir, kwargs = sys.argv[1], json.loads(sys.argv[2])
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_pipette.probe import run_probe

    timeout_s = float(os.environ.get("PIPETTE_PROBE_TEST_TIMEOUT_S", "60"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    if os.environ.get("PIPETTE_PROBE_TEST_STUCK_RANK") == os.environ["RANK"]:
        time.sleep(3600)            # a rank that never arrives: the others must give up, not hang
    if os.environ.get("PIPETTE_PROBE_TEST_DIE_RANK") == os.environ["RANK"]:
        delay = float(os.environ["PIPETTE_PROBE_TEST_DIE_AFTER_S"])
        threading.Timer(delay, os._exit, args=(3,)).start()
    if os.environ.get("PIPETTE_PROBE_TEST_SLOW_RANK") == os.environ["RANK"]:
        _slow_down_this_process()   # after the imports, which it would slow to a crawl
    probed = run_probe(**kwargs)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(None if probed is None else probed.to_json(), f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
