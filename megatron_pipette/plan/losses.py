"""Plans for the loss of a node, made before it happens, and taken after it without a search.

Why: when a node is lost, the job restarts on the survivors and needs a plan at once, but a search
of every layout takes seconds to minutes at scale (about 10 s for GPT-3 175B on 2048 nodes). Which
layouts rank best on N-1 nodes hardly depends on which node was lost (the world size, the memory
and the compute are the same; only links and placement differ), so at plan time one search on the
allocation less one node keeps its best layouts (the loss plan, made by `plan.planner.plan`), and
after a loss `place_layouts` places the best of those few that runs on the survivors' own links. Pure:
no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import Infeasible, PipetteError
from megatron_pipette.plan.placement import optimize_placement
from megatron_pipette.plan.planner import Candidate, Plan
from megatron_pipette.plan.search import Rejections
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import Workload


def place_layouts(workload: Workload, model: CostModel, layouts: Sequence[Layout], *,
                  constraints: Mapping[str, Any] | None = None, top: int = 1) -> Plan:
    """The planner's steps after its search, for the given layouts only, best first: the first `top`
    that Megatron accepts on the model's cluster, keep the constraints and fit are placed on its links
    and ranked. One by default: the stored ranking was made on all but one of these nodes, and a
    placement on thousands of nodes costs a fraction of a second."""
    cluster, constraints = model.cluster, constraints or {}
    rejected, candidates, out_of_memory = Rejections(), [], 0
    for layout in layouts:
        if any(getattr(layout, name) != value for name, value in constraints.items()):
            continue
        try:
            job = resolve_job(workload, layout, cluster.world_size)
        except Infeasible as e:
            rejected.add(e)
            continue
        except PipetteError:
            continue
        memory = model.memory(job)
        if not memory.fits:
            out_of_memory += 1
            continue
        placement, time = optimize_placement(model, job)
        candidates.append(Candidate(layout=job.layout, placement=placement, time=time, memory=memory,
                                    default_order_time_s=model.time(job).iteration_time_s))
        if len(candidates) == top:
            break
    candidates.sort(key=lambda c: c.time.iteration_time_s)
    return Plan(workload=workload, cluster_name=cluster.name, world_size=cluster.world_size,
                candidates=tuple(candidates), considered=len(layouts), out_of_memory=out_of_memory,
                rejected=dict(rejected.counts), rejection_examples=dict(rejected.examples))
