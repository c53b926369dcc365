"""A start plans from what the cache holds: the cached probe, and the calibration a self-check fitted
(torch-free: rank 0's part of the hook, on a cluster whose links the truth makes 10x slower)."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from helpers.checks import samples_where
from helpers.clusters import cpu_like
from helpers.plans import chosen
from megatron_pipette.calibration.check import compare
from megatron_pipette.calibration.document import CalibrationRecord
from megatron_pipette.calibration.fit import Factors, calibrated
from megatron_pipette.integration import replan
from megatron_pipette.integration.cache import CALIBRATION, CLUSTER, PLAN, PROFILE, Entry
from megatron_pipette.integration.common import Phases
from megatron_pipette.integration.plan_check import JobRequest
from megatron_pipette.plan.planner import plan
from megatron_pipette.spec.cluster_file import cluster_to_json
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import SCHEMA as PROFILE_SCHEMA
from megatron_pipette.spec.layer_profile import profile_from_json, profile_model_fields
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset
from megatron_pipette.units import GiB, MiB

TINY = workload_from_preset("tiny-gpt")
PROBED = calibrated(cpu_like(), None, Factors(link_bandwidth={"intra_node": 0.1})).cluster
"""What the probe measured: a CPU-like cluster whose links data parallelism's all-reduce can afford."""
TRUTH = Factors(compute_rate=0.5, link_bandwidth={"intra_node": 0.1})
"""How it runs: links 10x slower than probed, where a pipeline is faster."""
CONSTRAINTS = {"sequence_parallel": False}
REQUEST = JobRequest(workload=TINY, world_size=4, gpus_per_node=4, typed=CONSTRAINTS)
PROFILE_DOC = {"schema": PROFILE_SCHEMA, "version": 1, "device": {"rank": 0, "device_name": "cpu"},
               "model": profile_model_fields(TINY),
               "layers": [{"tensor_model_parallel_size": tp, "micro_batch_size": 1, "forward_s": 2e-3 / tp,
                           "backward_s": 4e-3 / tp, "activation_bytes": 500000 // tp} for tp in (1, 2, 4)]}


@pytest.fixture
def cache(tmp_path: Path) -> Entry:
    """A cache entry holding a probe (links 10x faster than the truth's) and a layer profile."""
    entry = Entry(tmp_path, "k")
    entry.open()
    entry.write(CLUSTER, cluster_to_json(PROBED, "fp32"))
    entry.write(PROFILE, PROFILE_DOC)
    return entry


def start(cache: Entry, request: JobRequest = REQUEST, **switches) -> dict:
    """What a start of the job plans with (rank 0's look-up), when nothing needs measuring."""
    found = replan.look_up(cache, request, replan.Switches(**switches), Phases())
    assert found.plan is not None
    return found.plan.to_json()


def self_check(cache: Entry) -> CalibrationRecord:
    """What the self-check of the cached plan stores (replan.calibrate): the truth's times, fitted."""
    cached = cache.read(PLAN)
    layout, placement = cached.best.layout, cached.best.placement
    samples = samples_where(calibrated(PROBED, profile_from_json(PROFILE_DOC), TRUTH), resolve_job(TINY, layout),
                            placement)
    replan.calibrate(cache, cached, compare(cached.best.iteration_time_s, cached.best.memory.stages, samples, (2, 6)))
    return cache.read(CALIBRATION)


def describe(doc: dict) -> str:
    return chosen(doc)[0].describe()


def test_a_cached_probe_is_planned_from_without_probing(cache: Entry, capsys) -> None:
    doc = start(cache)
    assert "planning from the probe and layer profile cached in" in capsys.readouterr().out
    assert cache.read(PLAN).to_json() == json.loads(json.dumps(doc)) and "calibration" not in doc
    assert describe(doc) == "tp1 pp1 dp4 mbs4 dopt+opg"


def test_a_start_names_the_flags_it_kept_and_the_entry_it_stored_and_how_to_plan_again(cache: Entry, capsys) -> None:
    start(cache)
    out = capsys.readouterr().out
    assert "\nKept fixed, not searched: without --sequence-parallel.\n" in out
    assert (f"> auto-parallel: plan stored in {cache.file(PLAN)} (allocation k): a later start of this job on this "
            "allocation reuses it; --auto-parallel-replan plans again from the cached probe and layer profile, "
            "--auto-parallel-reprobe measures again\n") in out
    start(cache)
    assert (f"> auto-parallel: using the plan in {cache.file(PLAN)} (allocation k); probe and profile skipped "
            "(--auto-parallel-replan plans again)\n") in capsys.readouterr().out


def test_a_calibration_is_reported_and_the_layout_kept_unless_asked(cache: Entry, capsys) -> None:
    """The truth's links are 10x slower: the calibrated model predicts the cached layout at the
    measured time and finds a pipeline layout faster, but keeps the cached one by default."""
    start(cache)
    calibration = self_check(cache)
    capsys.readouterr()
    doc = start(cache)
    out = capsys.readouterr().out
    assert "calibrated model: compute x0.5, memory-bound work x1, intra-node links x0.1 of the modelled rates" in out
    assert describe(doc) == "tp1 pp1 dp4 mbs4 dopt+opg"
    assert doc["candidates"][0]["iteration_time_s"] == pytest.approx(calibration.fitted_on.measured_s)
    assert "the calibrated model's best is tp1 pp4 dp1" in out
    assert "keeping the cached layout; --auto-parallel-replan-if-slower PCT switches" in out
    assert doc["calibration"]["id"] == calibration.id
    again = start(cache)
    assert again == json.loads(json.dumps(doc)) and "using the plan in" in capsys.readouterr().out


@pytest.mark.parametrize("pct, switched", [(1.0, True), (95.0, False)])
def test_replan_if_slower_switches_past_its_threshold(cache: Entry, capsys, pct: float, switched: bool) -> None:
    start(cache)
    self_check(cache)
    doc = start(cache, replan_if_slower=pct)
    out = capsys.readouterr().out
    best = calibrated(PROBED, profile_from_json(PROFILE_DOC), TRUTH)
    if switched:
        assert describe(doc).startswith("tp1 pp4 dp1") and f"(--auto-parallel-replan-if-slower {pct:g})" in out
        job = resolve_job(TINY, chosen(doc)[0])
        truth_s = best.time(job, chosen(doc)[1].logical_to_physical).iteration_time_s
        assert doc["candidates"][0]["iteration_time_s"] == pytest.approx(truth_s)
    else:
        assert describe(doc) == "tp1 pp1 dp4 mbs4 dopt+opg"
        assert f"keeping the cached layout: not more than {pct:g}% faster" in out


def test_nothing_valid_and_nothing_fitting_are_told_apart(cache: Entry) -> None:
    """When the flags as given leave no valid layout, the message says so and why, not that
    nothing fits (no layout was out of memory)."""
    from megatron_pipette.errors import PipetteError

    with pytest.raises(PipetteError, match=r"^no layout of this model is valid on 4 devices with the flags as "
                                           r"given \(1 rejected, e.g. --tensor-model-parallel-size 3 does not "
                                           r"divide the 4 GPUs\)"):
        start(cache, JobRequest(workload=TINY, world_size=4, gpus_per_node=4,
                                typed={**CONSTRAINTS, "tensor_model_parallel_size": 3}))


def test_five_starts_on_one_allocation_converge_and_never_switch_to_a_layout_that_fails(cache: Entry, capsys) -> None:
    """Five starts, each planning with what the last stored and switching at 1% (the calibrated loop at
    its most eager), each self-check measuring the truth with the spread of a shared machine (a step
    and each stage's passes off by a lognormal of 5%). One check measures no peak on stage 0 (its
    rank posted before its step's peak: 1 GiB low), one measures the passes a hundred times slower
    (a 2-process MoE run stored compute x1e+03 so). Neither is stored: the stored factors stay within
    10% of the truth, and every start trains a layout Megatron accepts that fits the device, where the
    device holds the truth's fastest layout less one MiB."""
    profile = profile_from_json(PROFILE_DOC)
    fastest = plan(TINY, calibrated(cache.read(CLUSTER).cluster, profile, TRUTH), constraints=CONSTRAINTS,
                   top_k=1).best
    cache.write(CLUSTER, cluster_to_json(dataclasses.replace(PROBED, memory_bytes=fastest.memory.peak_bytes - MiB),
                                         "fp32"))
    truth = calibrated(cache.read(CLUSTER).cluster, profile, TRUTH)
    rng = np.random.default_rng(33)
    chosen_layouts = []
    for i in range(5):
        doc = start(cache, replan_if_slower=1.0)
        layout, placement = chosen(doc)
        job = resolve_job(TINY, layout)          # Megatron accepts it (Infeasible otherwise) ...
        assert truth.memory(job).fits, (i, layout.describe())      # ... and it fits
        chosen_layouts.append(layout.describe())
        step = float(rng.lognormal(0, 0.05))
        samples = [dataclasses.replace(
            s, iteration_s=s.iteration_s * step, forward_backward_s=s.forward_backward_s * step,
            compute_s=s.compute_s * float(rng.lognormal(0, 0.05)) * (100 if i == 3 else 1),
            memory=dataclasses.replace(s.memory, outside_allocator=s.memory.outside_allocator - GiB * (i == 1)))
            for s in samples_where(truth, job, placement, memory_excess=0)]
        cached = cache.read(PLAN)
        replan.calibrate(cache, cached, compare(cached.best.iteration_time_s, cached.best.memory.stages, samples,
                                                (2, 6)))
        stored = cache.read(CALIBRATION).factors
        for got, want, band in ((stored.compute_rate, TRUTH.compute_rate, 1.1),
                                (stored.link_bandwidth["intra_node"], TRUTH.link_bandwidth["intra_node"], 1.25)):
            assert abs(math.log(got / want)) < math.log(band), (i, stored)
        assert stored.memory_overhead_bytes >= 0, (i, stored)
    out = capsys.readouterr().out
    assert out.count("calibration not stored: compute rate reached the bound of its search") == 1, out
    assert fastest.layout.describe() not in chosen_layouts


def test_a_calibration_that_leaves_no_layout_fitting_is_dropped_and_the_job_plans_uncalibrated(cache: Entry,
                                                                                              capsys) -> None:
    """An overhead within its bound (a quarter of the device) can still leave nothing fitting on a small
    device; every planning start then trained with the flags as given. Now the calibration is dropped,
    in one line, and the start plans without it."""
    device = 12 * GiB // 5                     # 2.4 GiB: the model's least peak here is 2.0
    cache.write(CLUSTER, cluster_to_json(dataclasses.replace(PROBED, memory_bytes=device), "fp32"))
    cache.write(CALIBRATION, {"schema": "megatron-pipette/calibration", "version": 1, "id": "c0ffee",
                              "factors": {"compute_rate": 1.0, "memory_rate": 1.0, "link_bandwidth": {},
                                          "memory_overhead_bytes": device // 4},
                              "fitted_on": {"layout": dataclasses.asdict(Layout()), "measured_s": 0.2,
                                            "predicted_s": 0.1, "device_memory_bytes": device}})
    doc = start(cache)
    assert (f"WARNING: with the calibration in {cache.file(CALIBRATION)} (memory overhead +0.60 GiB per device) no "
            "layout fits: it is dropped, and the job plans uncalibrated") in capsys.readouterr().out
    assert "calibration" not in doc and cache.read(CALIBRATION) is None


def test_a_start_keeps_the_memory_headroom_the_job_asks_for(cache: Entry, capsys) -> None:
    """On a 3 GiB device the distributed optimizer's layout leaves 16% free; asked for 20%
    (--auto-parallel-memory-headroom 20) the start picks the one without it, 0.8% slower, 33% free."""
    import argparse

    from megatron_pipette.integration.options import add_auto_parallel_args

    parser = add_auto_parallel_args(argparse.ArgumentParser())
    asked = parser.parse_args(["--auto-parallel-memory-headroom", "20"]).auto_parallel_memory_headroom
    assert (asked, parser.parse_args([]).auto_parallel_memory_headroom) == (20.0, 5.0)
    for bad in ("100", "nan", "-1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--auto-parallel-memory-headroom", bad])
    assert "argument --auto-parallel-memory-headroom: must be a percentage under 100, got '100'" in \
        capsys.readouterr().err
    cache.write(CLUSTER, cluster_to_json(dataclasses.replace(PROBED, memory_bytes=3 * GiB), "fp32"))
    assert describe(start(cache)) == "tp1 pp1 dp4 mbs4 dopt+opg"
    roomy = start(cache, dataclasses.replace(REQUEST, memory_headroom=asked / 100), replan=True)
    assert describe(roomy) == "tp1 pp1 dp4 mbs4"
    assert ("Memory headroom: #1 leaves 32.9% free (2.0 of 3.0 GiB on its fullest stage); chosen over "
            "tp1 pp1 dp4 mbs4 dopt+opg, 0.8% faster but 16.3% free, under the 20% headroom margin.") in \
        capsys.readouterr().out
