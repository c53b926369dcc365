"""Measured layer profile vs the planner's roofline: how far off is the model?

    pipette compare layer_profile.json [--gpu H100-80GB]

For every layer entry: measured and modelled forward and backward time and
activation bytes, and their ratio (measured / model). Times use the planner's
own roofline (cost.compute.roofline_layer, at the catalog GPU's peak times the
default GEMM efficiency and datasheet memory bandwidth); activations its
formula (cost.memory.activation_bytes_per_layer). The workload is rebuilt from
the profile's "model" block. A profile taken with megatron-core's local layer
spec ran unfused attention whatever --attention-backend says, so the formula is
asked for unfused attention too. Without a catalog GPU (a CPU profile) only the
activations are compared.
"""

from __future__ import annotations

import dataclasses

from megatron_pipette.cost.compute import roofline_layer
from megatron_pipette.cost.memory import activation_bytes_per_layer
from megatron_pipette.spec.hardware import DEFAULT_GEMM_EFFICIENCY, GPU
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import ProfileFile
from megatron_pipette.spec.layout import Layout
from megatron_pipette.units import MiB


def compare(profiled: ProfileFile, gpu: GPU | None) -> list[dict]:
    """One row per layer entry: measured, model and measured/model for time and activations."""
    profile, workload = profiled.profile, profiled.workload()
    rows = []
    for e in profile.layers:
        rc = e.recompute_granularity
        layout = Layout(tensor_model_parallel_size=e.tensor_model_parallel_size, micro_batch_size=e.micro_batch_size,
                        sequence_parallel=e.sequence_parallel, recompute_granularity=rc,
                        recompute_method="uniform" if rc == "full" else None,
                        recompute_num_layers=1 if rc == "full" else None)
        job = resolve_job(dataclasses.replace(workload, global_batch_size=e.micro_batch_size), layout)
        row = {"tp": e.tensor_model_parallel_size, "mbs": e.micro_batch_size, "sp": e.sequence_parallel,
               "recompute": rc, "measured": e.measured, "activation_bytes": e.activation_bytes,
               "model_activation_bytes": activation_bytes_per_layer(job)}
        row["activation_ratio"] = row["activation_bytes"] / row["model_activation_bytes"]
        if gpu is not None:
            rate = gpu.peak(workload.precision) * DEFAULT_GEMM_EFFICIENCY
            work = roofline_layer(job, gpu.memory_bandwidth_Bps)
            fwd = work.forward.seconds(rate)
            bwd = (work.backward + work.recompute).seconds(rate)
            row.update(forward_s=e.forward_s, model_forward_s=fwd, forward_ratio=e.forward_s / fwd,
                       backward_s=e.backward_s, model_backward_s=bwd, backward_ratio=e.backward_s / bwd)
        rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    timed = rows and "forward_ratio" in rows[0]
    head = f"{'tp':>3} {'mbs':>4} {'sp':>3} {'recompute':>9} {'meas':>4}  {'act MiB':>9} {'model':>9} {'ratio':>6}"
    if timed:
        head += f"  {'fwd ms':>8} {'model':>8} {'ratio':>6}  {'bwd ms':>8} {'model':>8} {'ratio':>6}"
    lines = [head]
    for r in rows:
        line = (f"{r['tp']:>3} {r['mbs']:>4} {'y' if r['sp'] else '-':>3} {r['recompute'] or '-':>9} "
                f"{'y' if r['measured'] else '-':>4}  {r['activation_bytes'] / MiB:>9.3f} "
                f"{r['model_activation_bytes'] / MiB:>9.3f} {r['activation_ratio']:>6.3f}")
        if timed:
            line += (f"  {r['forward_s'] * 1e3:>8.3f} {r['model_forward_s'] * 1e3:>8.3f} {r['forward_ratio']:>6.2f}"
                     f"  {r['backward_s'] * 1e3:>8.3f} {r['model_backward_s'] * 1e3:>8.3f} {r['backward_ratio']:>6.2f}")
        lines.append(line)
    return "\n".join(lines)
