"""How long the in-job probe takes for real: N gloo processes on this machine.

    .venv/bin/python -m benchmarks.validation.probe_time [--nproc 8] [--nnodes 1] [--budget-s 30] [--large-bytes 4M]

Runs the probe under torchrun once (`--nnodes` agents on this host, each its own "node" by
torchrun's node rank) and prints the rounds inside and between nodes, the per-round time, the
probe's own duration and the launcher's wall time (which adds the torch import and rendezvous
of every process). For the probe at scale, see benchmarks/validation/probe_twin.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=30.0)
    p.add_argument("--large-bytes", default="4M")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--port", type=int, default=29577)
    args = p.parse_args()
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cluster.json"
        per_node = args.nproc // args.nnodes
        cmds = [[torchrun, f"--nnodes={args.nnodes}", f"--node-rank={k}", f"--nproc_per_node={per_node}",
                 "--master-addr=127.0.0.1", f"--master-port={args.port}", "-m", "megatron_pipette.probe",
                 "--out", str(out), "--budget-s", str(args.budget_s), "--large-bytes", args.large_bytes]
                for k in range(args.nnodes)]
        start = time.perf_counter()
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in cmds]
        results = [p.communicate(timeout=args.budget_s + 300) for p in procs]
        wall = time.perf_counter() - start
        if any(p.returncode != 0 for p in procs):
            print("\n".join(err[-4000:] for _, err in results), file=sys.stderr)
            return 1
        doc = json.loads(out.read_text())
    probe = doc["probe"]
    print(f"processes            {probe['world_size']} (gloo, CPU) on {doc['num_nodes']} node(s)")
    for phase in ("intra", "inter"):
        times = probe["round_times_s"][phase]
        if times:
            print(f"{phase}-node rounds     {probe[phase + '_rounds_measured']} of {probe[phase + '_rounds']}, "
                  f"median {statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms")
    print(f"probe total          {probe['duration_s']:.2f} s (budget {probe['budget_s']:g} s; compute check "
          f"included), skipped: {len(probe['skipped'])}")
    print(f"torchrun wall        {wall:.2f} s (adds torch import and rendezvous of {probe['world_size']} processes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
