"""Plan documents as `pipette plan --json` and the hook write them, for one chosen layout."""

import dataclasses

from megatron_pipette.cost.memory import StageMemory
from megatron_pipette.plan.placement import Placement
from megatron_pipette.report.plan_document import SCHEMA, VERSION, PlanRecord, workload_json
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import Workload

ONE_BYTE = StageMemory(stage=0, parameters=1, weight_bytes=1, gradient_bytes=0, optimizer_bytes=0, activation_bytes=0,
                       transient_bytes=0, overhead_bytes=0)


def plan_doc(workload: Workload, layout: Layout, node_order: tuple[int, ...] = (0,), gpus_per_node: int = 4) -> dict:
    """A plan document whose best candidate is `layout` placed by `node_order`, for `workload`."""
    return {"schema": SCHEMA, "version": VERSION, "model": workload_json(workload), "cluster": "test",
            "world_size": len(node_order) * gpus_per_node, "considered": 1, "out_of_memory": 0,
            "candidates": [{"layout": dataclasses.asdict(layout), "megatron_args": layout.megatron_args(),
                            "iteration_time_s": 0.1, "memory": {"peak_bytes": 1, "capacity_bytes": 2,
                                       "stages": [{**dataclasses.asdict(ONE_BYTE), "peak_bytes": 1}]},
                            "placement": {"node_order": list(node_order), "gpus_per_node": gpus_per_node}}]}


def chosen(doc: dict) -> tuple[Layout, Placement]:
    """The best candidate's layout and placement of a plan document, through its reader."""
    best = PlanRecord.from_json(doc, "plan").best
    return best.layout, best.placement
