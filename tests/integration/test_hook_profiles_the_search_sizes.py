"""The layer profile a start takes times exactly the sizes its search may ask for: the hook's shapes
are the search's own options (plan.search.profile_shapes), not a second rule."""

from types import SimpleNamespace

import pytest

from helpers.clusters import cpu_like
from megatron_pipette.integration import decide, replan
from megatron_pipette.integration.common import Phases
from megatron_pipette.integration.plan_check import JobRequest
from megatron_pipette.plan.search import enumerate_layouts
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.workload import workload_from_preset

CASES = {
    # The hook's old rule (TP 1, 2, 4, 8 within a node; micro-batches 1, 2, 4, 8; typed sizes ignored)
    # differs from the search in each: micro-batches of 16 and 32 ...
    "micro-batches beyond 8": ("gpt3-1.3b", preset_cluster("dgx-h100", num_nodes=2), {}),
    # ... TP across the nodes of one NVLink domain ...
    "TP in an NVL domain": ("gpt3-1.3b", preset_cluster("gb200-nvl72", num_nodes=4), {}),
    # ... and a typed micro-batch size, the only one the search tries.
    "a typed micro-batch": ("tiny-gpt", cpu_like(), {"micro_batch_size": 2, "sequence_parallel": False}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_profile_times_exactly_the_sizes_the_search_may_ask_for(case, monkeypatch):
    model, cluster, typed = CASES[case]
    workload = workload_from_preset(model)
    asked = {}

    def profile_layers(_workload, *, tp_sizes, micro_batch_sizes, cp_sizes, **_):
        asked.update(tp=set(tp_sizes), mbs=set(micro_batch_sizes), cp=set(cp_sizes))
        return SimpleNamespace(profile=None, to_json=dict)

    monkeypatch.setattr("megatron_pipette.profile.profile_layers", profile_layers)
    monkeypatch.setattr(replan, "plan_measured", lambda *a: None)
    request = JobRequest(workload=workload, world_size=cluster.world_size, gpus_per_node=cluster.gpus_per_node,
                         typed=typed)
    decide._profile_and_plan(request, replan.Start(cluster=cluster), None, None, False, 60.0, Phases())

    layouts = [job.layout for job in enumerate_layouts(workload, cluster.world_size, cluster.gpus_per_node, typed,
                                                       gpus_per_domain=cluster.gpus_per_domain)]
    assert asked == {"tp": {lay.tp for lay in layouts}, "mbs": {lay.micro_batch_size for lay in layouts},
                     "cp": {lay.cp for lay in layouts}}
