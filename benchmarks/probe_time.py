"""How long the in-job probe takes: 8 gloo processes on this machine, projected to 1024 GPUs.

    .venv/bin/python benchmarks/probe_time.py [--nproc 8] [--budget-s 30] [--large-bytes 4M]

Runs `torchrun --standalone -m megatron_pipette.probe` once and prints the
tournament's rounds, the per-round time (median of the agreed round times),
the probe's own duration and the launcher's wall time (which adds the torch
import and rendezvous of every process), and the point-to-point time at 1024
GPUs projected from the round count there (1023) and this per-round time.
The projection assumes the per-round time does not grow with N: each round is
N/2 disjoint pairs in parallel plus one all-reduce barrier, whose cost grows
only with log N on a real fabric.
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

from megatron_pipette.probe.budget import plan_budget


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=30.0)
    p.add_argument("--large-bytes", default="4M")
    p.add_argument("--target-gpus", type=int, default=1024)
    args = p.parse_args()
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cluster.json"
        cmd = [torchrun, "--standalone", f"--nproc_per_node={args.nproc}", "-m", "megatron_pipette.probe",
               "--out", str(out), "--budget-s", str(args.budget_s), "--large-bytes", args.large_bytes]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.budget_s + 300)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        doc = json.loads(out.read_text())
    probe = doc["probe"]
    times = probe["round_times_s"]
    per_round = statistics.median(times)
    n = probe["world_size"]
    pairs = n * (n - 1) // 2
    target_rounds = args.target_gpus - 1 if args.target_gpus % 2 == 0 else args.target_gpus
    print(f"processes            {n} (gloo, CPU), {pairs} pairs")
    print(f"rounds               {probe['rounds_measured']} of {probe['rounds']}")
    print(f"per round            median {per_round * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms, "
          f"max {max(times) * 1e3:.1f} ms")
    print(f"point-to-point total {sum(times):.3f} s")
    print(f"probe total          {probe['duration_s']:.2f} s (budget {probe['budget_s']:g} s; compute check "
          f"included), skipped: {len(probe['skipped'])}")
    print(f"torchrun wall        {wall:.2f} s (adds torch import and rendezvous of {n} processes)")
    projected = target_rounds * per_round
    print(f"projected at {args.target_gpus} GPUs: {target_rounds} rounds x {per_round * 1e3:.1f} ms = "
          f"{projected:.1f} s of point-to-point at {probe['repeats']} repeats")
    window = plan_budget(args.budget_s, with_collectives=True).p2p_deadline_s
    verdict = ("fits" if projected <= window else
               f"does not fit: the probe would cut repeats, then the large message, to "
               f"{window / target_rounds * 1e3:.1f} ms per round")
    print(f"  a {args.budget_s:g} s budget leaves ~{window:.1f} s for point-to-point: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
