"""run_probe: measure the job's own cluster; the schema document on rank 0.

Why in-job: the links and devices a job gets (which nodes, which switches,
which slow GPU) are only known once it runs; measuring them there, in a
bounded time, lets the planner use the real figures. Every rank takes part
(`probe.engine` over `probe.torch_transport`); rank 0 alone builds, validates
and writes the document, and tells the others only whether it succeeded, so no
rank receives or parses an O(nodes^2) document it has no use for.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import UTC, datetime, timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_pipette.errors import PipetteError
from megatron_pipette.files import write_cluster_file
from megatron_pipette.measure import compute
from megatron_pipette.probe.budget import plan_budget
from megatron_pipette.probe.comm import device_of
from megatron_pipette.probe.document import build_document, gpus_per_node
from megatron_pipette.probe.engine import run_engine
from megatron_pipette.probe.identity import identify
from megatron_pipette.probe.options import check_args, out_problem
from megatron_pipette.probe.torch_transport import TorchTransport
from megatron_pipette.spec.cluster_file import ClusterFile

log = logging.getLogger("megatron_pipette.probe")


def _from_root(group: dist.ProcessGroup | None, rank: int, value: object) -> object:
    """Rank 0's (small) `value`, on every rank."""
    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def _raise(answer: object) -> None:
    if isinstance(answer, tuple):
        kind, message = answer
        raise PipetteError(message) if kind == "user" else RuntimeError(message)


def run_probe(group: dist.ProcessGroup | None = None, *, budget_s: float, precision: str, small_bytes: int,
              large_bytes: int, repeats: int, out: str | os.PathLike | None = None,
              timeout_s: float | None = None, known_nodes: list[bool] | None = None) -> ClusterFile | None:
    """Probe the cluster formed by `group` (default: the world) within `budget_s` seconds.

    Collective: every rank of the group calls it with the same arguments. Returns the cluster
    file (docs/cluster-schema.md), typed, on rank 0 and None on the others; rank 0 also writes it
    to `out` when given. `timeout_s` bounds each point-to-point wait (default 60 s + the
    budget) so a dead partner ends the probe with an error rather than a hang. Raises
    PipetteError on every rank for a user error (bad argument, unwritable --out, ranks not in
    node blocks), RuntimeError on every rank when rank 0 fails otherwise. `known_nodes` (per node,
    the same on every rank, one at least False): nodes a probe measured before, whose pairs with
    each other are not measured again (probe.schedule).
    """
    check_args(budget_s, precision, small_bytes, large_bytes, repeats)
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else 60.0 + budget_s)
    device = device_of(group)
    rank = dist.get_rank(group)
    started_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    _raise(_from_root(group, rank, ("user", problem) if rank == 0 and (problem := out_problem(out)) else None))

    identities: list[dict] | None = [{}] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(identify(device), identities, group=group, group_dst=0)
    gpn: object = None
    if rank == 0:
        try:
            gpn = gpus_per_node([i["host"] for i in identities])
        except PipetteError as e:
            gpn = ("user", str(e))
    gpn = _from_root(group, rank, gpn)
    _raise(gpn)

    measured, note = compute.gemm_precision(precision, device)
    transport = TorchTransport(group, device, gpus_per_node=int(gpn), precision=measured,
                               small_bytes=small_bytes, large_bytes=large_bytes, timeout=timeout)
    measurements = run_engine(transport, plan_budget(budget_s), repeats=repeats, large_bytes=large_bytes,
                              known_nodes=None if known_nodes is None else np.array(known_nodes, dtype=bool))
    probed: ClusterFile | None = None
    answer: object = None
    failure: BaseException | None = None
    if rank == 0:
        meta = {"backend": str(dist.get_backend(group)), "budget_s": float(budget_s), "started_at": started_at,
                "requested_precision": precision, "gemm_n": transport.gemm_n}
        try:
            doc = build_document(measurements, identities, name=f"probe-{started_at}", precision=measured,
                                 small_bytes=small_bytes, large_bytes=large_bytes, max_repeats=repeats,
                                 probe_meta=meta, extra_skipped=[{"what": "gemm_precision", "reason": note}]
                                 if note and precision == "fp8" else ())
            probed = ClusterFile.from_json(doc, where="probe")   # the planner must accept it unchanged
            if out is not None:
                write_cluster_file(doc, probed.cluster.world_size, out)
            _log_outcome(probed, out, note)
        except PipetteError as e:
            answer = ("user", str(e))
        except Exception as e:   # a bug: still tell the other ranks, so that none waits for rank 0
            answer, failure = ("internal", f"probe failed on rank 0: {type(e).__name__}: {e}"), e
    answer = _from_root(group, rank, answer)
    if failure is not None:
        raise failure
    _raise(answer)
    return probed


def _log_outcome(probed: ClusterFile, out: str | os.PathLike | None, note: str | None) -> None:
    p = probed.probe
    if note:
        log.info("probe: %s", note)
    log.info("probe: %d ranks on %d node(s): %d of %d intra-node and %d of %d inter-node rounds, %d node pairs "
             "measured, %.2f s of a %.1f s budget%s", p.world_size, probed.cluster.num_nodes, p.intra_rounds_measured,
             p.intra_rounds, p.inter_rounds_measured, p.inter_rounds, p.node_pairs_measured,
             p.duration_s, p.budget_s, f"; wrote {out}" if out is not None else "")
    for reason in p.slow_nodes + p.slow_links:
        log.warning("probe: slow: %s", reason)
    if p.skipped:
        log.warning("probe: skipped to fit the budget or the node layout: %s", "; ".join(p.skipped))


def run_standalone(*, backend: str | None, budget_s: float, precision: str, small_bytes: int,
                   large_bytes: int | None, cpu_large_bytes: int, cuda_large_bytes: int, repeats: int,
                   out: str | os.PathLike, timeout_s: float) -> None:
    """`pipette probe`: join the job from the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT; without them a world of one), probe, write `out` on rank 0, leave."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise PipetteError("--backend nccl needs CUDA devices; use --backend gloo on CPU")
    large = large_bytes or (cuda_large_bytes if backend == "nccl" else cpu_large_bytes)
    check_args(budget_s, precision, small_bytes, large, repeats)
    timeout = timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:   # a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=timeout)
    elif backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=timeout, device_id=torch.device("cuda", local))
    else:
        dist.init_process_group(backend, timeout=timeout)
    run_probe(budget_s=budget_s, precision=precision, small_bytes=small_bytes, large_bytes=large,
              repeats=repeats, out=out, timeout_s=timeout_s)
    dist.destroy_process_group()
