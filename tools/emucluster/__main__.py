"""`python -m tools.emucluster`: run a command under torchrun on an emulated cluster, or clean up.

    python -m tools.emucluster run --spec '{"nodes": 8, "rate_mbit": 200, "overrides": {"2": {"rate_mbit": 50}},
        "pair_overrides": {"1-6": {"rate_mbit": 20}}}' \
        --nproc-per-node 1 --timeout 300 --logdir out/emu -- -m megatron_pipette.probe --out c.json
    python -m tools.emucluster cleanup [--all]     # delete leftover pipette-emu-* namespaces
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.emucluster import EmuCluster, cleanup_stale, free_port, unavailable_reason


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.emucluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="torchrun a script in every emulated node")
    r.add_argument("--spec", required=True,
                   help="JSON text or a JSON file: nodes, rate_mbit, delay_ms, overrides, pair_overrides")
    r.add_argument("--nproc-per-node", type=int, default=1)
    r.add_argument("--timeout", type=float, default=300.0, help="seconds before every process is killed")
    r.add_argument("--logdir", type=Path, default=None, help="write node<k>.log here (default: print)")
    r.add_argument("script", nargs=argparse.REMAINDER, help="after --: what torchrun runs")
    c = sub.add_parser("cleanup", help="delete leftover namespaces of dead processes")
    c.add_argument("--all", action="store_true", help="every pipette-emu-* namespace")
    args = p.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"emulated cluster unavailable: {reason}", file=sys.stderr)
        return 2
    if args.cmd == "cleanup":
        for name in cleanup_stale(all_of_them=args.all):
            print(f"deleted {name}")
        return 0
    text = args.spec
    desc = json.loads(Path(text).read_text() if Path(text).is_file() else text)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        p.error("give the torchrun script after --")
    with EmuCluster(desc) as cl:
        results = cl.torchrun(script, nproc_per_node=args.nproc_per_node, timeout=args.timeout,
                              logdir=args.logdir, port=free_port())
    for res in results:
        if args.logdir is None:
            print(f"===== node {res.node} (exit {res.returncode}) =====\n{res.output}")
        else:
            print(f"node {res.node}: exit {res.returncode}, log {args.logdir / f'node{res.node}.log'}")
    return max((abs(r.returncode or 0) for r in results), default=0) and 1


if __name__ == "__main__":
    sys.exit(main())
