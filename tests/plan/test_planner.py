from dataclasses import replace

import pytest

from helpers.plans import chosen
from megatron_pipette.cost.memory import estimate_memory
from megatron_pipette.cost.model import CostModel
from megatron_pipette.plan.placement import default_placement
from megatron_pipette.plan.planner import HEADROOM_TIME, MEMORY_HEADROOM, least_recompute, misfit_advice, plan
from megatron_pipette.plan.search import enumerate_layouts
from megatron_pipette.report.plan_document import plan_json
from megatron_pipette.report.plans import plan_report
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset


def test_best_candidate_is_the_fastest_fitting_layout():
    w = workload_from_preset("gpt3-1.3b", global_batch_size=64)
    cluster = preset_cluster("dgx-a100", num_nodes=1)
    result = plan(w, CostModel(cluster), top_k=5)
    times = [c.time.iteration_time_s for c in result.candidates]
    assert times == sorted(times) and len(times) == 5
    assert all(c.memory.fits for c in result.candidates)
    identity = default_placement(cluster).logical_to_physical
    brute = min(CostModel(cluster).time(job, identity).iteration_time_s
                for job in enumerate_layouts(w, 8, 8) if estimate_memory(job, cluster.memory_bytes).fits)
    assert times[0] <= brute * (1 + 1e-12)
    # The best ones are exact (the simulator's answer), so the planner does not re-simulate them.
    best = result.candidates[0]
    assert best.time.exact_schedule and best.simulated_time_s is None
    again = CostModel(cluster).time(resolve_job(w, best.layout), best.placement.logical_to_physical, simulate=True)
    assert again.iteration_time_s == pytest.approx(best.time.iteration_time_s, rel=1e-9)


def test_constraints_are_respected():
    w = workload_from_preset("gpt3-1.3b", global_batch_size=64)
    result = plan(w, CostModel(preset_cluster("dgx-a100", num_nodes=2)),
                  constraints={"tensor_model_parallel_size": 2, "use_distributed_optimizer": False})
    assert result.candidates
    assert all(c.layout.tp == 2 and not c.layout.use_distributed_optimizer for c in result.candidates)


def test_slow_node_plan_places_ranks(slow_node_cluster):
    w = workload_from_preset("gpt3-1.3b", global_batch_size=64)
    cluster = slow_node_cluster(num_nodes=4, slow_node=1, factor=10)
    # 1F1B is a chain, so the slow node's position matters. (Interleaved stages form a ring, where
    # every position has two neighbours and whole-node placement cannot help.) Without sequence
    # parallelism every TP rank sends the whole activation, so the slow hops dominate.
    result = plan(w, CostModel(cluster), constraints={"pipeline_model_parallel_size": 4,
                                                      "tensor_model_parallel_size": 8,
                                                      "num_layers_per_virtual_pipeline_stage": None,
                                                      "sequence_parallel": False})
    best = result.candidates[0]
    assert not best.placement.is_default
    assert best.time.iteration_time_s < best.default_order_time_s


def test_nothing_fits_explains_what_would():
    w = workload_from_preset("gpt3-175b")
    cluster = preset_cluster("dgx-a100", num_nodes=1)
    result = plan(w, CostModel(cluster))
    assert result.candidates == () and result.out_of_memory == result.considered > 0
    advice = " ".join(misfit_advice(w, cluster, result))
    assert "more GPUs" in advice and "closest" in advice


def test_plan_document_round_trips_the_choice(slow_node_cluster):
    w = workload_from_preset("gpt3-1.3b", global_batch_size=64)
    result = plan(w, CostModel(slow_node_cluster(num_nodes=4)), constraints={"pipeline_model_parallel_size": 4})
    doc = plan_json(result)
    layout, placement = chosen(doc)
    assert layout == result.candidates[0].layout and placement == result.candidates[0].placement
    first = doc["candidates"][0]
    assert {"iteration_time_s", "tflops_per_gpu", "memory", "placement", "megatron_args"} <= set(first)
    assert all("peak_bytes" in s for s in first["memory"]["stages"])


def test_full_recomputation_is_cut_to_the_fewest_layers_that_fit():
    """GPT-3 13B on one DGX A100, tp1 pp2 dp4 mbs2: nothing fits without recomputation, every layer
    recomputed fits; the planner recomputes the first k layers of each stage (block k) with k the
    smallest that fits, which is faster than recomputing all."""
    w = workload_from_preset("gpt3-13b", global_batch_size=64)
    model = CostModel(preset_cluster("dgx-a100", num_nodes=1))
    layout = Layout(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, data_parallel_size=4,
                    micro_batch_size=2, use_distributed_optimizer=True, recompute_granularity="full",
                    recompute_method="uniform", recompute_num_layers=1)
    every = resolve_job(w, layout)
    assert model.memory(every).fits
    assert not model.memory(resolve_job(w, replace(layout, recompute_granularity=None, recompute_method=None,
                                                   recompute_num_layers=None))).fits
    job, memory = least_recompute(model, every, model.memory(every))
    k = job.layout.recompute_num_layers
    assert job.layout.recompute_method == "block" and 1 < k < min(every.stage_layers) and memory.fits
    assert not model.memory(resolve_job(w, replace(job.layout, recompute_num_layers=k - 1))).fits
    assert model.time(job).iteration_time_s < model.time(every).iteration_time_s


def test_recomputation_the_user_fixed_is_kept():
    w = workload_from_preset("gpt3-13b", global_batch_size=64)
    fixed = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    result = plan(w, CostModel(preset_cluster("dgx-a100", num_nodes=1)), constraints=fixed, top_k=3)
    assert result.candidates
    assert all((c.layout.recompute_granularity, c.layout.recompute_method, c.layout.recompute_num_layers)
               == ("full", "uniform", 1) for c in result.candidates)


@pytest.fixture(scope="module")
def gpt13_on_a_dgx():
    """GPT-3 1.3B on one DGX A100, every fitting layout ranked by time (no headroom asked)."""
    w = workload_from_preset("gpt3-1.3b")
    model = CostModel(preset_cluster("dgx-a100", num_nodes=1))
    return w, model, plan(w, model, top_k=40, memory_headroom=0)


def test_a_layout_without_headroom_gives_way_to_one_as_fast_with_room(gpt13_on_a_dgx):
    """The fastest layout (mbs16) leaves 4.9% of the device free, under the 5% margin; mbs8, 0.7%
    slower, leaves 45%: it is the pick, even when one candidate is asked for, and the plan names the
    faster one it passed over."""
    w, model, every = gpt13_on_a_dgx
    fastest = every.best
    assert fastest.memory.headroom < MEMORY_HEADROOM
    within = [c for c in every.candidates if c.memory.headroom >= MEMORY_HEADROOM
              and c.time.iteration_time_s <= (1 + HEADROOM_TIME) * fastest.time.iteration_time_s]
    picked = plan(w, model, top_k=1)
    assert picked.best.layout == within[0].layout and picked.best.layout.micro_batch_size == 8
    assert picked.passed_over.layout == fastest.layout and picked.memory_headroom == MEMORY_HEADROOM
    report = plan_report(picked)
    assert (f"Memory headroom: #1 leaves 45.1% free (43.9 of 80.0 GiB on its fullest stage); chosen over "
            f"{fastest.layout.describe()}, 0.7% faster but 4.9% free, under the 5% headroom margin.") in report, report


def test_without_a_layout_with_headroom_near_its_time_the_fastest_is_picked_and_said_so(gpt13_on_a_dgx):
    w, model, every = gpt13_on_a_dgx
    none = plan(w, model, top_k=3, memory_headroom=0.9)
    assert none.best.layout == every.best.layout and none.passed_over is None
    assert ("leaves 4.9% free (76.1 of 80.0 GiB on its fullest stage), under the 90% headroom margin: no layout "
            "within 2% of its time leaves that much, so the fastest is chosen.") in plan_report(none)
    assert "Memory headroom: #1 leaves 4.9% free (76.1 of 80.0 GiB on its fullest stage).\n" in plan_report(every)


def test_pipette_plan_takes_the_margin_and_refuses_one_it_cannot_keep(capsys):
    from megatron_pipette.cli.main import main

    args = ["plan", "--model", "gpt3-1.3b", "--num-nodes", "1", "--top", "1"]
    assert main([*args, "--memory-headroom", "0"]) == 0
    assert "tp1 pp1 dp8 mbs16 dopt+opg" in capsys.readouterr().out
    assert main([*args, "--memory-headroom", "100"]) == 2
    assert capsys.readouterr().err.strip().endswith("--memory-headroom must be a percentage of 0 or more and "
                                                    "under 100, got 100")
