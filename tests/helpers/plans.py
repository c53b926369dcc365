"""Plan documents as `pipette plan --json` and the hook write them, for one chosen layout."""

import dataclasses

from megatron_pipette.report.plan_document import SCHEMA, VERSION
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import Workload


def plan_doc(workload: Workload, layout: Layout, node_order: tuple[int, ...] = (0,), gpus_per_node: int = 4) -> dict:
    """A plan document whose best candidate is `layout` placed by `node_order`, for `workload`."""
    return {"schema": SCHEMA, "version": VERSION, "model": dataclasses.asdict(workload), "cluster": "test",
            "world_size": len(node_order) * gpus_per_node, "considered": 1, "out_of_memory": 0,
            "candidates": [{"layout": dataclasses.asdict(layout), "megatron_args": layout.megatron_args(),
                            "iteration_time_s": 0.1, "memory": {"peak_bytes": 1, "capacity_bytes": 2},
                            "placement": {"node_order": list(node_order), "gpus_per_node": gpus_per_node}}]}
