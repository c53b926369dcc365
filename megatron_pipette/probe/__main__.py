"""`torchrun --nproc_per_node N -m megatron_pipette.probe --out cluster.json`: probe, write, exit.

Initialises the default process group from the torchrun environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; a plain `python -m` run is a
world of one), runs the probe, and has rank 0 write the document. A user
error or a failed peer ends every rank with one line on stderr and exit
status 1 (2 for bad flags), never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from datetime import timedelta

from megatron_pipette.errors import PipetteError
from megatron_pipette.probe.options import check_args, out_problem

DEFAULT_LARGE_CUDA = 64 * 2**20
DEFAULT_LARGE_CPU = 4 * 2**20


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 2): "4K", "64M"."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_pipette.probe",
                                description="Measure this job's cluster (links inside and between nodes, "
                                            "devices) and write the pipette cluster file.")
    p.add_argument("--out", required=True, help="cluster JSON to write (rank 0 writes it atomically)")
    p.add_argument("--budget-s", type=float, default=30.0, help="seconds the probe may take (default 30)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="process-group backend (default: nccl when CUDA is available, else gloo)")
    p.add_argument("--precision", default="bf16", help="training precision of the GEMM check (default bf16)")
    p.add_argument("--small-bytes", type=_size, default=4096, help="latency message size (default 4K)")
    p.add_argument("--large-bytes", type=_size, default=None,
                   help="bandwidth message size (default 64M on GPU, 4M on CPU)")
    p.add_argument("--repeats", type=int, default=5, help="timed exchanges per size and pair (default 5)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="give up on an unresponsive peer after this long (default 60 s + the budget)")
    p.add_argument("-v", "--verbose", action="store_true", help="log each stage's timing on every rank")
    return p.parse_args(argv)


def _init(backend: str, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    if backend == "nccl" and not torch.cuda.is_available():
        raise PipetteError("--backend nccl needs CUDA devices; use --backend gloo on CPU")
    timeout = timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:   # plain `python -m`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=timeout)
        return
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=timeout, device_id=torch.device("cuda", local))
    else:
        dist.init_process_group(backend, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = os.environ.get("RANK", "0")
    level = logging.DEBUG if args.verbose else logging.INFO if rank == "0" else logging.WARNING
    logging.basicConfig(level=level,
                        format="pipette %(message)s", stream=sys.stderr)
    try:
        # Flags first: a typo should not cost a torch import and a rendezvous.
        check_args(args.budget_s, args.precision, args.small_bytes, args.large_bytes or args.small_bytes + 1,
                   args.repeats)
        timeout_s = args.timeout_s if args.timeout_s is not None else 60.0 + args.budget_s
        if not timeout_s > 0:
            raise PipetteError(f"--timeout-s must be positive, got {args.timeout_s}")
        if "RANK" not in os.environ and (problem := out_problem(args.out)):
            raise PipetteError(problem)   # a world of one: this process is rank 0, the writer

        import torch
        import torch.distributed as dist

        backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        large = args.large_bytes or (DEFAULT_LARGE_CUDA if backend == "nccl" else DEFAULT_LARGE_CPU)
        check_args(args.budget_s, args.precision, args.small_bytes, large, args.repeats)
        _init(backend, timeout_s)
        from megatron_pipette.probe.runner import run_probe

        run_probe(budget_s=args.budget_s, precision=args.precision, small_bytes=args.small_bytes,
                  large_bytes=large, repeats=args.repeats, out=args.out,
                  timeout_s=timeout_s)
        dist.destroy_process_group()
        return 0
    except PipetteError as e:
        print(f"pipette probe: rank {rank}: {e}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError, ConnectionError) as e:   # a failed or unreachable peer
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"pipette probe: rank {rank}: communication failed: {first}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
