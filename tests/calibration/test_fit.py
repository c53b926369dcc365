"""The calibration fit: factors recovered from a check the model itself produced under known
factors, the inputs scaled without n x n copies, and the stored document (torch-free)."""

import dataclasses
import json

import pytest

from helpers.checks import samples_where
from helpers.clusters import cpu_like
from megatron_pipette.calibration.check import GiB, RankSample, compare
from megatron_pipette.calibration.document import CalibrationRecord
from megatron_pipette.calibration.fit import AVERAGED_FITS, Factors, Fit, calibrated, fit, merge
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
    truth = Factors(compute_rate=0.4, memory_rate=0.1, link_bandwidth={"intra_node": 0.1})
    check, placement = check_of(cluster, LAYOUTS[name], truth)
    fitted = fit(TINY, cluster, None, LAYOUTS[name], placement, check)
    f = fitted.factors
    assert f.compute_rate == pytest.approx(0.4, rel=0.01), fitted.line()
    assert f.memory_rate == pytest.approx(0.1, rel=0.01), fitted.line()
    assert f.link_bandwidth["intra_node"] == pytest.approx(0.1, rel=0.02), fitted.line()
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
    from megatron_pipette.spec.layer_profile import LayerProfile, ProfiledModel, ProfileEntry

    cluster = cpu_like()
    entry = ProfileEntry(tensor_model_parallel_size=1, micro_batch_size=4, forward_s=0.01, backward_s=0.02,
                         activation_bytes=1000)
    profile = LayerProfile(device_name="cpu", rank=0, layers=(entry,), embedding=(entry,), output_layer=(entry,),
                           model=ProfiledModel())
    job = resolve_job(TINY, LAYOUTS["dp4"])
    base = calibrated(cluster, profile, Factors()).time(job).stage_times[0]
    half = calibrated(cluster, profile, Factors(compute_rate=0.5)).time(job).stage_times[0]
    profiled = (TINY.num_layers + 2) * (entry.forward_s + entry.backward_s) * cluster.gemm_flops[0] \
        / cluster.gemm_flops.min()
    assert sum(base) == pytest.approx(profiled) and sum(half) == pytest.approx(2 * profiled)


WRITTEN_LAYOUT = {
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 4,
    "micro_batch_size": 4, "num_layers_per_virtual_pipeline_stage": None, "sequence_parallel": False,
    "tp_comm_overlap": False, "use_distributed_optimizer": False, "recompute_granularity": None,
    "recompute_method": None, "recompute_num_layers": None, "recompute_modules": None,
    "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
    "pipeline_model_parallel_layout": None, "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False, "overlap_grad_reduce": True, "overlap_param_gather": False,
    "overlap_param_gather_with_optimizer_step": False, "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": None, "context_parallel_size": 1, "cp_comm_type": "p2p",
    "overlap_moe_expert_parallel_comm": False, "delay_wgrad_compute": False}
"""The layout of a CPU rehearsal's calibration.json, as the hook wrote it before the record was typed."""


def test_a_document_written_before_the_record_was_typed_reads_and_writes_back_new_fields_at_default() -> None:
    doc = {"schema": "megatron-pipette/calibration", "version": 1, "factors": {
        "compute_rate": 1.0434915753790066, "memory_rate": 0.05037420638752311,
        "link_bandwidth": {"intra_node": 0.3071553156141707}, "memory_overhead_bytes": 0},
        "fits": {"compute_rate": 1, "memory_rate": 1, "intra_node": 1},
        "fitted_on": {"layout": WRITTEN_LAYOUT, "node_order": [0], "iterations": [2, 6],
                      "measured_s": 0.11080296400086809, "predicted_s": 0.06900179066404145,
                      "calibrated_s": 0.11080296399889555, "notes": [], "device_memory_bytes": 6319125504},
        "id": "1f4ed52df2ec0c13"}
    read = CalibrationRecord.from_json(doc, "c.json")
    assert read.fitted_on.layout == Layout(data_parallel_size=4, micro_batch_size=4, overlap_grad_reduce=True)
    written = json.loads(json.dumps(read.to_json()))
    added = {k: v for k, v in dataclasses.asdict(Layout()).items() if k not in WRITTEN_LAYOUT}
    assert written == {**doc, "fitted_on": {**doc["fitted_on"], "layout": {**WRITTEN_LAYOUT, **added}}}
    without = {**doc, "fitted_on": {k: v for k, v in doc["fitted_on"].items() if k != "layout"}}
    with pytest.raises(PipetteError, match=r"^c.json: malformed calibration \(fitted_on.layout is None"):
        CalibrationRecord.from_json(without, "c.json")


def test_the_stored_document_round_trips_and_names_a_bad_one() -> None:
    cluster = cpu_like()
    check, placement = check_of(cluster, LAYOUTS["dp4"], Factors(compute_rate=0.4, link_bandwidth={"intra_node": 0.5}))
    fitted = fit(TINY, cluster, None, LAYOUTS["dp4"], placement, check)
    record = CalibrationRecord.of(fitted, LAYOUTS["dp4"], placement, check)
    doc = json.loads(json.dumps(record.to_json()))
    read = CalibrationRecord.from_json(doc, "c.json")
    assert read == record and read.to_json() == doc and read.factors == fitted.factors
    assert read.fitted_on.measured_s == check.measured_s and len(read.id) == 16
    assert read.fitted_on.layout == LAYOUTS["dp4"]
    assert read.fitted_on.device_memory_bytes == cluster.memory_bytes
    assert read.fits == dict.fromkeys(fitted.fitted, 1) and "compute_rate" in read.fits
    with pytest.raises(PipetteError, match="^c.json: malformed calibration"):
        CalibrationRecord.from_json({"schema": "megatron-pipette/calibration", "version": 1}, "c.json")


def test_a_plan_with_calibrated_factors_prefers_what_they_favour() -> None:
    """Links 100x slower than probed move the plan off data parallelism's all-reduce."""
    cluster = cpu_like()
    before = plan(TINY, CostModel(cluster), top_k=1).best.layout
    after = plan(TINY, calibrated(cluster, None, Factors(link_bandwidth={"intra_node": 0.01})), top_k=1).best.layout
    assert (before.dp, after.dp) == (4, 1), (before, after)


CAPACITY = preset_cluster("dgx-h100").memory_bytes


@pytest.mark.parametrize("factors, overhead, why", [
    ({"compute_rate": 1e-9}, 0, "the compute factor x1e-09 is outside x0.25-x4"),
    ({"compute_rate": 1e9}, 0, "the compute factor x1e\\+09 is outside x0.25-x4"),
    ({"compute_rate": float("nan")}, 0, "the compute factor xnan is outside"),
    ({"memory_rate": 1e3}, 0, "the memory-bound factor x1e\\+03 is outside x0.002-x4"),
    ({"link_bandwidth": {"inter_node": 1e-3}}, 0, "the inter-node link factor x0.001 is outside x0.05-x4"),
    ({}, -GiB, "the memory overhead -1.00 GiB per device is outside 0-25% of the device"),
    ({}, CAPACITY // 2, "the memory overhead \\+39.59 GiB per device is outside 0-25% of the device"),
])
def test_a_stored_calibration_outside_its_physical_bounds_is_refused(factors, overhead, why) -> None:
    """Factors of 1e-9 or 1e9 and a negative overhead were read and planned with (one run predicted
    1.2e8 s per iteration); the reader now refuses them, and the cache sets the file aside."""
    doc = {"schema": "megatron-pipette/calibration", "version": 1, "id": "c0ffee",
           "factors": {"compute_rate": 1.0, "memory_rate": 1.0, "link_bandwidth": {}, "memory_overhead_bytes": overhead,
                       **factors},
           "fitted_on": {"layout": dataclasses.asdict(Layout()), "measured_s": 0.2, "predicted_s": 0.1,
                         "device_memory_bytes": CAPACITY}}
    with pytest.raises(PipetteError, match=f"^c.json: {why}.*: not a physical calibration$"):
        CalibrationRecord.from_json(doc, "c.json")
    doc["factors"] = {"compute_rate": 4.0, "memory_rate": 1 / 500, "link_bandwidth": {"inter_node": 0.05},
                      "memory_overhead_bytes": CAPACITY // 4}
    assert CalibrationRecord.from_json(doc, "c.json").factors.compute_rate == 4.0     # the bounds are inside


def test_a_fit_at_a_bound_of_its_search_is_refused() -> None:
    """A 2-process MoE run stored compute x1e+03, the old search's limit; passes a hundred times slower
    than the layer profile are a missing term, not a rate: the fit ends at the bound and says so."""
    cluster = cpu_like()
    check, placement = check_of(cluster, LAYOUTS["pp2-dp2"], Factors(compute_rate=0.4))
    slower = dataclasses.replace(check, stages=tuple(dataclasses.replace(s, compute_s=100 * s.compute_s)
                                                     for s in check.stages))
    fitted = fit(TINY, cluster, None, LAYOUTS["pp2-dp2"], placement, slower)
    assert fitted.factors.compute_rate == 0.25 and fitted.at_bound == ("compute_rate",)
    assert fitted.refusal().startswith("compute rate reached the bound of its search")
    assert fit(TINY, cluster, None, LAYOUTS["pp2-dp2"], placement, check).refusal() is None


def test_a_fit_no_closer_than_the_uncalibrated_model_is_refused() -> None:
    cluster = cpu_like()
    check, placement = check_of(cluster, LAYOUTS["pp2-dp2"], Factors())     # the model is the truth
    fitted = fit(TINY, cluster, None, LAYOUTS["pp2-dp2"], placement, check)
    assert fitted.uncalibrated_error == pytest.approx(0, abs=1e-9)
    assert fitted.refusal().startswith("it reproduces the check no better than the uncalibrated model")


def test_a_peak_under_the_models_adds_no_negative_overhead() -> None:
    cluster = cpu_like()
    check, placement = check_of(cluster, LAYOUTS["pp2-dp2"], Factors(compute_rate=0.4), memory_excess=-GiB)
    assert fit(TINY, cluster, None, LAYOUTS["pp2-dp2"], placement, check).factors.memory_overhead_bytes == 0


def test_fits_of_one_allocation_merge_into_a_running_geometric_mean() -> None:
    """Each rate is the geometric mean of its fits (the newest weighted at least 1/AVERAGED_FITS); a
    factor a check did not measure is kept; the overhead is the largest seen."""
    def fitted(compute: float, links: dict, overhead: int | None) -> Fit:
        names = ("compute_rate", *links) + (() if overhead is None else ("memory_overhead_bytes",))
        return Fit(factors=Factors(compute_rate=compute, link_bandwidth=links, memory_overhead_bytes=overhead or 0),
                   predicted_s=1, calibrated_s=1, measured_s=1, fitted=names)

    factors, counts = merge(Factors(), {}, fitted(2.0, {"intra_node": 0.5}, GiB))
    assert (factors.compute_rate, factors.link_bandwidth, counts) == \
        (2.0, {"intra_node": 0.5}, {"compute_rate": 1, "intra_node": 1, "memory_overhead_bytes": 1})
    factors, counts = merge(factors, counts, fitted(0.5, {}, 2 * GiB))
    assert factors.compute_rate == pytest.approx(1.0) and factors.link_bandwidth == {"intra_node": 0.5}
    assert factors.memory_rate == 1.0 and factors.memory_overhead_bytes == 2 * GiB
    factors, counts = merge(factors, counts, fitted(8.0, {"intra_node": 2.0}, 0))
    assert factors.compute_rate == pytest.approx(2.0) and factors.link_bandwidth == {"intra_node": pytest.approx(1.0)}
    assert factors.memory_overhead_bytes == 2 * GiB and counts["compute_rate"] == 3
    factors, _ = merge(factors, {**counts, "compute_rate": 100}, fitted(16.0, {}, None))
    assert factors.compute_rate == pytest.approx((2.0 ** (AVERAGED_FITS - 1) * 16.0) ** (1 / AVERAGED_FITS))
