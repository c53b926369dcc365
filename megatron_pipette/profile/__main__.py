"""`python -m megatron_pipette.profile`: write a layer profile for a model on this device.

    python -m megatron_pipette.profile --model gpt3-1.3b --tp 1 2 4 --mbs 1 2 4 \\
        --out layer_profile.json [--device cuda|cpu] [--budget-s 60]

Model flags are Megatron-LM's (--hidden-size, --swiglu, --bf16, ...) and override
the --model preset; without --model, --num-layers, --hidden-size,
--num-attention-heads and --seq-length are required. User errors print one line
and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from megatron_pipette.errors import PipetteError
from megatron_pipette.cli.args import add_workload_flags, workload_from_args
from megatron_pipette.spec.workload import Workload

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
RECOMPUTE_CHOICES = {"none": None, "selective": "selective", "full": "full"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_pipette.profile",
        description="Measure one transformer layer, the embedding and the output layer (with loss) on this "
                    "device, sharded as for each tensor-parallel size, and write the layer-profile JSON "
                    "the planner reads with --layer-profile.")
    run = parser.add_argument_group("profile")
    run.add_argument("--tp", type=int, nargs="+", default=[1], metavar="N",
                     help="tensor-parallel sizes to profile (default: 1)")
    run.add_argument("--mbs", type=int, nargs="+", default=[1], metavar="N",
                     help="micro-batch sizes; the smallest and largest are measured, the rest interpolated")
    run.add_argument("--recompute", nargs="+", choices=sorted(RECOMPUTE_CHOICES), default=list(RECOMPUTE_CHOICES),
                     help="recompute granularities to profile (default: none selective full)")
    run.add_argument("--no-sequence-parallel", action="store_true",
                     help="leave out the sequence-parallel entries")
    run.add_argument("--out", default="layer_profile.json", help="output file (default: layer_profile.json)")
    run.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available, else cpu")
    run.add_argument("--budget-s", type=float, default=300.0,
                     help="wall-clock budget in seconds; shapes that would exceed it are skipped (default 300)")
    run.add_argument("--warmup", type=int, default=3, help="untimed iterations per shape (default 3)")
    run.add_argument("--iters", type=int, default=10, help="timed iterations per shape; the median is kept")
    run.add_argument("--rank", type=int, help="this device's rank in the cluster file (default: 0)")

    add_workload_flags(parser)
    return parser


def workload_from_namespace(ns: argparse.Namespace) -> Workload:
    # A layer profile does not depend on the global batch size.
    return workload_from_args(ns, None, required=REQUIRED, global_batch_size=1)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    # megatron-core warns at import about optional kernels (Apex, TE) it falls back from.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    try:
        workload = workload_from_namespace(ns)
        out = Path(ns.out)
        if not out.parent.is_dir():
            raise PipetteError(f"--out {out}: directory {out.parent} does not exist")
        from megatron_pipette.profile.profiler import profile_layers

        doc = profile_layers(workload, tp_sizes=ns.tp, micro_batch_sizes=ns.mbs,
                             recompute=tuple(RECOMPUTE_CHOICES[r] for r in ns.recompute),
                             sequence_parallel=(False,) if ns.no_sequence_parallel else (False, True),
                             device=ns.device, budget_s=ns.budget_s, warmup=ns.warmup, iters=ns.iters,
                             rank=ns.rank)
        try:
            out.write_text(json.dumps(doc, indent=1) + "\n")
        except OSError as e:
            raise PipetteError(f"--out {out}: cannot write ({e.strerror})") from None
    except PipetteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = doc["measurement"]
    print(f"{out}: {len(doc['layers'])} layer entries on {doc['device']['device_name']}, "
          f"{len(m['measured'])} shapes measured, {len(m['skipped'])} skipped (budget or memory), "
          f"{m['elapsed_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
