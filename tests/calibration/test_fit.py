"""The calibration fit: factors recovered from a check the model itself produced under known
factors, the inputs scaled without n x n copies, and the stored document (torch-free)."""

import dataclasses
import json

import pytest

from helpers.checks import samples_where
from helpers.clusters import cpu_like
from megatron_pipette.calibration.check import GiB, RankSample, compare
from megatron_pipette.calibration.document import CalibrationRecord
from megatron_pipette.calibration.fit import Factors, calibrated, fit
from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import PipetteError
from megatron_pipette.plan.placement import Placement
from megatron_pipette.plan.planner import evaluate, plan
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset

TINY = workload_from_preset("tiny-gpt")


def check_of(cluster, layout: Layout, truth_factors: Factors, memory_excess: int | None = None):
    job = resolve_job(TINY, layout)
    placement = Placement(tuple(range(cluster.num_nodes)), cluster.gpus_per_node)
    time, memory = evaluate(CostModel(cluster), job, placement)
    samples = samples_where(calibrated(cluster, None, truth_factors), job, placement, memory_excess)
    return compare(time.iteration_time_s, memory.stages, samples, (2, 6)), placement


LAYOUTS = {
    "dp4": Layout(data_parallel_size=4, micro_batch_size=4, use_distributed_optimizer=True, overlap_grad_reduce=True,
                  overlap_param_gather=True),
    "pp2-dp2": Layout(pipeline_model_parallel_size=2, data_parallel_size=2, micro_batch_size=2),
    "tp2-dp2": Layout(tensor_model_parallel_size=2, data_parallel_size=2, micro_batch_size=4),
    "pp2-interleaved-dp2": Layout(pipeline_model_parallel_size=2, data_parallel_size=2, micro_batch_size=2,
                                  num_layers_per_virtual_pipeline_stage=1),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_factors_are_recovered_from_a_check(name: str) -> None:
    cluster = cpu_like()
    truth = Factors(compute_rate=0.4, memory_rate=0.1, link_bandwidth={"intra_node": 0.05})
    check, placement = check_of(cluster, LAYOUTS[name], truth)
    fitted = fit(TINY, cluster, None, LAYOUTS[name], placement, check)
    f = fitted.factors
    assert f.compute_rate == pytest.approx(0.4, rel=0.01), fitted.line()
    assert f.memory_rate == pytest.approx(0.1, rel=0.01), fitted.line()
    assert f.link_bandwidth["intra_node"] == pytest.approx(0.05, rel=0.02), fitted.line()
    assert fitted.calibrated_s == pytest.approx(check.measured_s, rel=1e-3)
    assert fitted.notes == ()


def test_links_of_several_nodes_get_one_factor_for_both_kinds() -> None:
    cluster = cpu_like(nodes=2, gpn=2)
    truth = Factors(compute_rate=2.0, link_bandwidth={"intra_node": 3.0, "inter_node": 3.0})
    check, placement = check_of(cluster, LAYOUTS["pp2-dp2"], truth)
    f = fit(TINY, cluster, None, LAYOUTS["pp2-dp2"], placement, check).factors
    assert set(f.link_bandwidth) == {"intra_node", "inter_node"}
    assert f.link_bandwidth["inter_node"] == pytest.approx(3.0, rel=0.02)


def test_links_a_layout_barely_waits_on_are_left_as_probed() -> None:
    """GPT-3 1.3B data-parallel on one DGX hides its all-reduce behind the backward: a timing error
    of 1% would move a link factor more than 2x, so none is fitted; compute still is."""
    cluster = preset_cluster("dgx-a100", num_nodes=1, gpus_per_node=8)
    workload = workload_from_preset("gpt3-1.3b")
    layout = Layout(data_parallel_size=8, micro_batch_size=4, overlap_grad_reduce=True)
    job = resolve_job(workload, layout)
    placement = Placement((0,), 8)
    time, memory = evaluate(CostModel(cluster), job, placement)
    est = calibrated(cluster, None, Factors(compute_rate=0.8)).time(job, placement.logical_to_physical)
    samples = [RankSample(rank=0, stage=0, iteration_s=est.iteration_time_s,
                          forward_backward_s=est.iteration_time_s - est.breakdown.optimizer_s,
                          compute_s=sum(est.stage_times[0]) * job.num_microbatches, memory=None)]
    check = compare(time.iteration_time_s, memory.stages, samples, (2, 6))
    fitted = fit(workload, cluster, None, layout, placement, check)
    assert fitted.factors.link_bandwidth == {}
    assert fitted.factors.compute_rate == pytest.approx(0.8, rel=0.01)
    assert fitted.notes == ("halving or doubling the link rates moves this layout's schedule by under 1%: "
                            "links left as probed",)


def test_time_the_links_cannot_explain_leaves_them_as_probed() -> None:
    cluster = cpu_like()
    check, placement = check_of(cluster, LAYOUTS["pp2-dp2"], Factors(compute_rate=0.4))
    slower = dataclasses.replace(check, forward_backward_s=check.forward_backward_s * 1e4,
                                 measured_s=check.measured_s + check.forward_backward_s * (1e4 - 1))
    fitted = fit(TINY, cluster, None, LAYOUTS["pp2-dp2"], placement, slower)
    assert fitted.factors.link_bandwidth == {}
    assert any("links left as probed" in n for n in fitted.notes), fitted.notes


def test_memory_overhead_is_the_worst_stages_excess() -> None:
    cluster = cpu_like()
    check, placement = check_of(cluster, LAYOUTS["pp2-dp2"], Factors(), memory_excess=3 * GiB)
    fitted = fit(TINY, cluster, None, LAYOUTS["pp2-dp2"], placement, check)
    assert fitted.factors.memory_overhead_bytes == 3 * GiB
    model = calibrated(cluster, None, fitted.factors)
    job = resolve_job(TINY, LAYOUTS["pp2-dp2"])
    assert model.memory(job).stages[0].total_bytes == check.stages[0].measured_peak_bytes


def test_calibrated_inputs_keep_uniform_levels_as_views() -> None:
    """A 16,384-node preset scaled must not materialise its node x node matrices."""
    cluster = preset_cluster("dgx-h100", num_nodes=16384)
    model = calibrated(cluster, None, Factors(compute_rate=2.0, link_bandwidth={"inter_node": 0.5}))
    bw = model.cluster.inter_node.bandwidth_Bps
    assert bw.strides == (0, 0) and bw[0, 1] == cluster.inter_node.bandwidth_Bps[0, 1] * 0.5
    assert model.cluster.gemm_flops[0] == 2 * cluster.gemm_flops[0]
    assert model.cluster.intra_node[0].bandwidth_Bps[0, 1] == cluster.intra_node[0].bandwidth_Bps[0, 1]


def test_scaled_compute_scales_profiled_layers_too() -> None:
    """The profile's layers run at profiled rate / device rate: pinning the profiled rate makes the
    compute factor reach them as it reaches the roofline."""
    from megatron_pipette.spec.layer_profile import LayerProfile, ProfileEntry

    cluster = cpu_like()
    entry = ProfileEntry(tensor_model_parallel_size=1, micro_batch_size=4, forward_s=0.01, backward_s=0.02,
                         activation_bytes=1000)
    profile = LayerProfile(device_name="cpu", rank=0, layers=(entry,), embedding=(entry,), output_layer=(entry,),
                           model={})
    job = resolve_job(TINY, LAYOUTS["dp4"])
    base = calibrated(cluster, profile, Factors()).time(job).stage_times[0]
    half = calibrated(cluster, profile, Factors(compute_rate=0.5)).time(job).stage_times[0]
    profiled = (TINY.num_layers + 2) * (entry.forward_s + entry.backward_s) * cluster.gemm_flops[0] \
        / cluster.step_gemm_flops.min()
    assert sum(base) == pytest.approx(profiled) and sum(half) == pytest.approx(2 * profiled)


def test_the_stored_document_round_trips_and_names_a_bad_one() -> None:
    cluster = cpu_like()
    check, placement = check_of(cluster, LAYOUTS["dp4"], Factors(compute_rate=0.4, link_bandwidth={"intra_node": 2}))
    fitted = fit(TINY, cluster, None, LAYOUTS["dp4"], placement, check)
    record = CalibrationRecord.of(fitted, LAYOUTS["dp4"], placement, check)
    doc = json.loads(json.dumps(record.to_json()))
    read = CalibrationRecord.from_json(doc, "c.json")
    assert read == record and read.to_json() == doc and read.factors == fitted.factors
    assert read.fitted_on.measured_s == check.measured_s and len(read.id) == 16
    doc["factors"]["compute_rate"] = -1
    with pytest.raises(PipetteError, match="^c.json: calibration factors must be positive"):
        CalibrationRecord.from_json(doc, "c.json")
    with pytest.raises(PipetteError, match="^c.json: malformed calibration"):
        CalibrationRecord.from_json({"schema": "megatron-pipette/calibration", "version": 1}, "c.json")


def test_a_plan_with_calibrated_factors_prefers_what_they_favour() -> None:
    """Links 100x slower than probed move the plan off data parallelism's all-reduce."""
    cluster = cpu_like()
    before = plan(TINY, CostModel(cluster), top_k=1).best.layout
    after = plan(TINY, calibrated(cluster, None, Factors(link_bandwidth={"intra_node": 0.01})), top_k=1).best.layout
    assert (before.dp, after.dp) == (4, 1), (before, after)
