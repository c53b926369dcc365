"""Plans and estimates as JSON documents (pure dicts; callers do the I/O).

The same document is what `pipette plan --json` prints, what the in-job hook
writes beside the checkpoint, and what `--auto-parallel-plan-file` pins.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_pipette.cost.memory import MemoryEstimate
from megatron_pipette.cost.timing import TimeEstimate
from megatron_pipette.errors import PipetteError
from megatron_pipette.plan.placement import Placement
from megatron_pipette.plan.planner import Candidate, Plan
from megatron_pipette.spec.layout import Layout

SCHEMA = "megatron-pipette/plan"
VERSION = 1


def memory_json(memory: MemoryEstimate) -> dict[str, Any]:
    return {
        "capacity_bytes": memory.capacity_bytes,
        "peak_bytes": memory.peak_bytes,
        "fits": memory.fits,
        "tight": memory.tight,
        "stages": [{**dataclasses.asdict(s), "peak_bytes": s.total_bytes} for s in memory.stages],
    }


def estimate_json(layout: Layout, time: TimeEstimate, memory: MemoryEstimate) -> dict[str, Any]:
    return {
        "layout": dataclasses.asdict(layout),
        "megatron_args": layout.megatron_args(),
        "iteration_time_s": time.iteration_time_s,
        "tflops_per_gpu": time.tflops_per_gpu,
        "breakdown_s": time.breakdown.as_dict(),
        "memory": memory_json(memory),
    }


def candidate_json(c: Candidate) -> dict[str, Any]:
    return {
        **estimate_json(c.layout, c.time, c.memory),
        "default_order_time_s": c.default_order_time_s,
        "simulated_time_s": c.simulated_time_s,
        "placement": {"node_order": list(c.placement.node_order),
                      "gpus_per_node": c.placement.gpus_per_node},
    }


def plan_json(result: Plan) -> dict[str, Any]:
    return {
        "schema": SCHEMA, "version": VERSION,
        "model": dataclasses.asdict(result.workload),
        "cluster": result.cluster_name,
        "world_size": result.world_size,
        "considered": result.considered,
        "out_of_memory": result.out_of_memory,
        "candidates": [candidate_json(c) for c in result.candidates],
    }


def chosen_from_json(doc: Any, where: str) -> tuple[Layout, Placement]:
    """The best candidate's layout and placement from a plan document (to pin a plan), after checking
    every part of the document its users read: the model, the best candidate's time and memory."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or doc.get("version") != VERSION:
        raise PipetteError(f"{where}: not a megatron-pipette plan (schema {SCHEMA} version {VERSION})")
    if not isinstance(doc.get("candidates"), list) or not doc["candidates"]:
        raise PipetteError(f"{where}: the plan has no candidate")
    if not isinstance(doc.get("model"), dict):
        raise PipetteError(f"{where}: the plan has no model")
    best = doc["candidates"][0]
    try:
        layout = Layout(**best["layout"])
        placement = Placement(tuple(best["placement"]["node_order"]), int(best["placement"]["gpus_per_node"]))
        figures = [best["iteration_time_s"], best["memory"]["peak_bytes"], best["memory"]["capacity_bytes"]]
    except (KeyError, TypeError, ValueError, PipetteError) as e:
        raise PipetteError(f"{where}: malformed candidate ({e})") from None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in figures):
        raise PipetteError(f"{where}: malformed candidate (iteration_time_s and memory must be numbers)")
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in placement.node_order) \
            or placement.gpus_per_node <= 0:
        raise PipetteError(f"{where}: malformed candidate (node_order must list integers, gpus_per_node be "
                           f"positive)")
    return layout, placement
