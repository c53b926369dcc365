"""`profile_layers`: measure one transformer layer, the embedding and the output layer on one device.

The result is the layer-profile document (megatron_pipette.spec.layer_profile,
schema version 1) the planner reads instead of its roofline estimate. Beyond the
schema's keys it records, in "measurement", how it was taken: the spec used, the
budget, and which shapes were measured and which the budget cut.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from megatron_pipette.measure.compute import gemm_precision, gemm_rate, prepare_gemm
from megatron_pipette.profile import build, measure
from megatron_pipette.profile.request import check_request
from megatron_pipette.profile.runtime import Environment, device_record, resolve_device, single_device_megatron
from megatron_pipette.profile.shapes import Measured, Shape, estimate_wall_s, layer_entries, part_entries, plan_shapes
from megatron_pipette.spec.layer_profile import SCHEMA, VERSION, ProfiledModel, ProfileFile
from megatron_pipette.spec.workload import Workload

REFERENCE_GEMM_WINDOW_S = 0.3
"""Seconds of the reference GEMM (the probe's compute-check size)."""

def profile_layers(workload: Workload, *, tp_sizes: Sequence[int], micro_batch_sizes: Sequence[int],
                   recompute: Sequence[str | None] = (None, "selective", "full"),
                   sequence_parallel: Sequence[bool] = (False, True), device: str | torch.device | None = None,
                   budget_s: float = 300.0, warmup: int = 3, iters: int = 10, rank: int | None = None,
                   cp_sizes: Sequence[int] = (1,)) -> ProfileFile:
    """Measure per-rank compute time and activation memory for each TP size; return the layer-profile file
    (its schema document, read back by its one reader: what the planner would read from the file).

    For each TP size the layer is built with that rank's shapes (see profile.build) and
    timed forward and backward; the smallest and largest micro-batch sizes are measured
    and the others interpolated ("measured": false). Each context-parallel size in
    `cp_sizes` above 1 adds a layer over one CP rank's shard, seq_length / CP tokens: its
    linears, norms and activations are the rank's; its attention meets the shard's own keys
    only, and the planner adds the other ranks' (cost.compute.profile_layer). Shapes are measured most useful
    first (profile.shapes.plan_shapes) and skipped once `budget_s` (wall seconds)
    would be exceeded by the estimated cost of the next one; the first layer shape is
    always measured. A shape that runs out of device memory is skipped too ("out of
    memory"), so one too large does not lose the others. The budget clock starts once
    megatron-core is imported and the process groups are up (a few seconds, recorded
    as "setup_s"). `rank` is the device's rank in the cluster file (default: this
    process's torch.distributed rank).
    """
    check_request(workload, tp_sizes, micro_batch_sizes, recompute, sequence_parallel, budget_s, warmup, iters,
                  cp_sizes, rank)
    dev = resolve_device(device)
    results: list[Measured] = []
    skipped: list[dict] = []
    setup = time.perf_counter()
    with single_device_megatron(dev) as env:
        te = build.have_transformer_engine()
        reference = reference_gemm_flops(workload.precision, dev)
        start = time.perf_counter()
        for shape in plan_shapes(tp_sizes, micro_batch_sizes, recompute, cp_sizes):
            estimate = estimate_wall_s(shape, results)
            have_layer = any(m.shape.part == "layer" for m in results)
            if have_layer and estimate is not None and time.perf_counter() - start + estimate > budget_s:
                skipped.append({**shape.describe(), "reason": f"budget (estimated {estimate:.2f} s)"})
                continue
            try:
                results.append(_measure(workload, shape, env, te, warmup, iters))
            except torch.OutOfMemoryError:
                # The device's memory, not the budget, ends this shape; the others may still fit.
                skipped.append({**shape.describe(), "reason": "out of memory"})
                torch.cuda.empty_cache()
        elapsed = time.perf_counter() - start
        record = {**device_record(dev, env.rank if rank is None else rank), **reference}
    return ProfileFile.from_json({
        "schema": SCHEMA, "version": VERSION, "device": record,
        "model": ProfiledModel.of(workload).to_json(),
        "layers": layer_entries(results, tp_sizes=tp_sizes, micro_batch_sizes=micro_batch_sizes,
                                recompute=recompute, sequence_parallel=sequence_parallel,
                                seq_length=workload.seq_length),
        "embedding": part_entries(results, "embedding", tp_sizes=tp_sizes, micro_batch_sizes=micro_batch_sizes),
        "output_layer": part_entries(results, "output_layer", tp_sizes=tp_sizes,
                                     micro_batch_sizes=micro_batch_sizes),
        "measurement": {
            "layer_spec": "transformer_engine" if te else "local",
            "masked_softmax_fusion": build.fused_softmax(dev),
            "torch": torch.__version__, "megatron_core": _megatron_version(),
            "timing": "cuda events" if dev.type == "cuda" else "perf_counter",
            "activation_bytes": "saved-tensor hooks, distinct storages, parameters and shared inputs excluded",
            "tp_communication": "excluded (one-rank groups); the planner models it from the link matrix",
            "sequence_parallel": "activations of norms, dropout and QKV/FC1 inputs divided by TP; "
                                 "times are the non-SP measurement's",
            "context_parallel": "a layer over seq_length / CP tokens, attending to its own keys only",
            "warmup": warmup, "iters": iters, "budget_s": budget_s,
            "setup_s": round(start - setup, 3), "elapsed_s": round(elapsed, 3),
            "measured": [{**m.shape.describe(), "wall_s": round(m.wall_s, 3)} for m in results],
            "skipped": skipped,
        },
    }, where="layer profile")


def reference_gemm_flops(precision: str, device: torch.device) -> dict:
    """The probe's GEMM on this device just before profiling, alone: the planner turns the
    profile's times into work at this rate and back into time at each device's probed rate,
    so devices that were slower when the probe loaded them all at once (shared CPU cores,
    throttling) are slower in the plan too."""
    measured, _ = gemm_precision(precision, device)
    step, flops_per_step, _ = prepare_gemm(device, measured)
    return {"gemm_flops": gemm_rate(step, flops_per_step, REFERENCE_GEMM_WINDOW_S, device),
            "gemm_precision": measured}


def _measure(workload: Workload, shape: Shape, env: Environment, te: bool, warmup: int, iters: int) -> Measured:
    t0 = time.perf_counter()
    tp, mbs = shape.tensor_model_parallel_size, shape.micro_batch_size
    if shape.part == "layer":
        shard = dataclasses.replace(workload, seq_length=workload.seq_length // shape.context_parallel_size)
        step = build.layer_step(shard, tp, mbs, shape.recompute_granularity, env, te)
    elif shape.part == "embedding":
        step = build.embedding_step(workload, tp, mbs, env, te)
    else:
        step = build.output_step(workload, tp, mbs, env, te)
    saved, extra = measure.activation_pass(step, env.device)
    timing = measure.time_step(step, env.device, warmup, iters)
    sharded = saved.in_modules(build.SEQUENCE_SHARDED_MODULES) if shape.part == "layer" else 0
    del step
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    return Measured(shape=shape, forward_s=timing.forward_s, backward_s=timing.backward_s,
                    activation_bytes=saved.total, sequence_sharded_bytes=sharded,
                    wall_s=time.perf_counter() - t0,
                    run_s=(1 + warmup + iters) * timing.iteration_s,
                    extra=tuple(sorted(extra.items())))


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "unknown"
