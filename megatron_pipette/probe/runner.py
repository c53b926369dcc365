"""run_probe: measure the job's own cluster and return the schema document on every rank.

Why in-job: the links and devices a job gets (which nodes, which switches,
which slow GPU) are only known once it runs; measuring them there, in a
bounded time, lets the planner use the real figures. Every rank takes part;
rank 0 gathers plain data, builds and validates the document, writes it, and
broadcasts it (or the one error message) so that all ranks return the same
thing or fail with the same PipetteError.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import torch.distributed as dist

from megatron_pipette.errors import PipetteError
from megatron_pipette.files import atomic_path
from megatron_pipette.probe import collectives, compute
from megatron_pipette.probe.budget import plan_budget
from megatron_pipette.probe.comm import Clock, agree_max, device_of
from megatron_pipette.probe.document import RankReport, build_document, gpus_per_node
from megatron_pipette.probe.identity import identify
from megatron_pipette.probe.options import check_args, out_problem
from megatron_pipette.probe.p2p import measure_pairs
from megatron_pipette.spec.cluster_file import cluster_from_json

log = logging.getLogger("megatron_pipette.probe")

def write_cluster_file(doc: dict, path: str | os.PathLike) -> None:
    """Write the document atomically (temporary file + os.replace): readers never see half a file."""
    indent = 1 if doc["probe"]["world_size"] <= 64 else None   # big matrices stay compact
    with atomic_path(path, "--out") as tmp:
        tmp.write_text(json.dumps(doc, indent=indent) + "\n")


def _one_answer(group: dist.ProcessGroup | None, rank: int, value: object) -> object:
    """Rank 0's `value`, on every rank."""
    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def run_probe(group: dist.ProcessGroup | None = None, *, budget_s: float, precision: str, small_bytes: int,
              large_bytes: int, repeats: int, tp_sizes: Sequence[int] | None = None,
              out: str | os.PathLike | None = None, timeout_s: float | None = None) -> dict:
    """Probe the cluster formed by `group` (default: the world) within `budget_s` seconds.

    Collective: every rank of the group calls it with the same arguments.
    Returns the cluster document (docs/cluster-schema.md), identical on every
    rank; rank 0 also writes it to `out` when given. `tp_sizes` are the
    tensor-parallel group sizes to time all-reduce on (default: every
    divisor >= 2 of the GPUs per node). `timeout_s` bounds each
    point-to-point wait (default 60 s + the budget) so a dead partner ends the
    probe with an error rather than a hang. Raises PipetteError on every rank
    for a user error (bad argument, unwritable --out, ranks not in node blocks).
    """
    check_args(budget_s, precision, small_bytes, large_bytes, repeats)
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else 60.0 + budget_s)
    device = device_of(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    started_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    problem = _one_answer(group, rank, out_problem(out) if rank == 0 else None)
    if problem:
        raise PipetteError(str(problem))
    identities: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(identities, identify(device), group=group)
    clock = Clock()   # the budget runs from here: every rank has arrived
    gpn = gpus_per_node([i["host"] for i in identities])
    sizes, rejected = collectives.candidate_tp_sizes(gpn, tp_sizes)
    plan = plan_budget(budget_s, with_collectives=bool(sizes))
    skipped = [{"what": "collectives", "tp_size": s,
                "reason": f"TP size {s} does not divide {gpn} devices per node"} for s in rejected]

    measured, note = compute.gemm_precision(precision, device)
    if note:
        if precision == "fp8":
            skipped.append({"what": "gemm_precision", "reason": note})
        if rank == 0:
            log.info("probe: %s", note)
    log.debug("probe: rank %d: identities gathered; plan %s", rank, plan)
    gemm_step, gemm_flops_per_step, gemm_n = compute.prepare_gemm(device, measured)
    copy_step, copy_bytes_per_step = compute.prepare_copy(device)
    agree_max(group, device, [0.0])   # start the windows together
    gemm_flops = compute.gemm_rate(gemm_step, gemm_flops_per_step, plan.gemm_window_s, device)
    copy_bps = compute.copy_bandwidth(copy_step, copy_bytes_per_step, plan.copy_window_s, device)
    del gemm_step, copy_step
    log.debug("probe: rank %d: compute check done at %.3f s", rank, clock.elapsed())

    pairs = measure_pairs(group, device, clock, deadline_s=plan.p2p_deadline_s, small_bytes=small_bytes,
                          large_bytes=large_bytes, repeats=repeats, timeout=timeout)
    log.debug("probe: rank %d: point-to-point done at %.3f s", rank, clock.elapsed())
    records, coll_skipped = collectives.measure_tp_allreduce(
        group, device, clock, gpus_per_node=gpn, sizes=sizes, nbytes=large_bytes, repeats=repeats,
        deadline_s=plan.collectives_deadline_s, timeout=timeout)

    log.debug("probe: rank %d: collectives done at %.3f s", rank, clock.elapsed())
    report = RankReport(identity=identities[rank], gemm_flops=gemm_flops, memory_bandwidth_Bps=copy_bps,
                        small_s=pairs.small_s, large_s=pairs.large_s, exchange_s=pairs.exchange_s,
                        exchange_medium_s=pairs.exchange_medium_s, collectives=records)
    reports: list[RankReport] | None = [None] * world if rank == 0 else None  # type: ignore[list-item]
    dist.gather_object(report, reports, group=group, group_dst=0)
    answer: dict | tuple[str, str] | None = None
    failure: BaseException | None = None
    if rank == 0:
        assert reports is not None
        meta = {"backend": str(dist.get_backend(group)), "budget_s": float(budget_s),
                "duration_s": round(clock.elapsed(), 4), "started_at": started_at,
                "requested_precision": precision, "gemm_n": gemm_n,
                "round_times_s": [round(t, 6) for t in pairs.round_times_s]}
        try:
            doc = build_document(reports, name=f"probe-{started_at}", precision=measured,
                                 small_bytes=small_bytes, large_bytes=large_bytes,
                                 round_configs=pairs.configs, max_repeats=repeats, probe_meta=meta,
                                 extra_skipped=skipped + coll_skipped)
            cluster_from_json(doc, where="probe")   # the planner must accept it unchanged
            if out is not None:
                write_cluster_file(doc, out)
            answer = doc
        except PipetteError as e:
            answer = ("user", str(e))
        except Exception as e:   # a bug: still tell the other ranks, so that none waits for a document
            answer, failure = ("internal", f"probe failed on rank 0: {type(e).__name__}: {e}"), e
        _log_outcome(answer, out)
    answer = _one_answer(group, rank, answer)
    if failure is not None:
        raise failure
    if isinstance(answer, tuple):
        kind, message = answer
        raise PipetteError(message) if kind == "user" else RuntimeError(message)
    assert isinstance(answer, dict)
    return answer


def _log_outcome(answer: object, out: str | os.PathLike | None) -> None:
    if not isinstance(answer, dict):
        return
    p = answer["probe"]
    times = p["round_times_s"]
    per_round = sorted(times)[len(times) // 2] if times else 0.0
    log.info("probe: %d ranks, %d of %d rounds (%.4f s per round), %.2f s of a %.1f s budget%s",
             p["world_size"], p["rounds_measured"], p["rounds"], per_round, p["duration_s"], p["budget_s"],
             f"; wrote {out}" if out is not None else "")
    if p["skipped"]:
        log.warning("probe: skipped to fit the budget or the node layout: %s",
                    "; ".join(s["reason"] for s in p["skipped"]))
