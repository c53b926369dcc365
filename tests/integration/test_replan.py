"""A start plans from what the cache holds: the cached probe, and the calibration a self-check fitted
(torch-free: rank 0's part of the hook, on a cluster whose links the truth makes 100x slower)."""

import json
from pathlib import Path

import pytest

from helpers.checks import samples_where
from helpers.clusters import cpu_like
from helpers.plans import chosen
from megatron_pipette.calibration.check import compare
from megatron_pipette.calibration.document import CalibrationRecord
from megatron_pipette.calibration.fit import Factors, calibrated, fit
from megatron_pipette.integration import replan
from megatron_pipette.integration.cache import CALIBRATION, CLUSTER, PLAN, PROFILE, Entry
from megatron_pipette.integration.common import Phases
from megatron_pipette.integration.plan_check import JobRequest
from megatron_pipette.spec.cluster_file import cluster_to_json
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import SCHEMA as PROFILE_SCHEMA
from megatron_pipette.spec.layer_profile import profile_from_json
from megatron_pipette.spec.workload import workload_from_preset

TINY = workload_from_preset("tiny-gpt")
TRUTH = Factors(compute_rate=0.5, link_bandwidth={"intra_node": 0.01})
CONSTRAINTS = {"sequence_parallel": False}
REQUEST = JobRequest(workload=TINY, world_size=4, gpus_per_node=4, typed=CONSTRAINTS)
PROFILE_DOC = {"schema": PROFILE_SCHEMA, "version": 1, "device": {"rank": 0, "device_name": "cpu"}, "model": {},
               "layers": [{"tensor_model_parallel_size": tp, "micro_batch_size": 1, "forward_s": 2e-3 / tp,
                           "backward_s": 4e-3 / tp, "activation_bytes": 500000 // tp} for tp in (1, 2, 4)]}


@pytest.fixture
def cache(tmp_path: Path) -> Entry:
    """A cache entry holding a probe (links 100x faster than the truth's) and a layer profile."""
    entry = Entry(tmp_path, "k")
    entry.open()
    entry.write(CLUSTER, cluster_to_json(cpu_like(), "fp32"))
    entry.write(PROFILE, PROFILE_DOC)
    return entry


def start(cache: Entry, request: JobRequest = REQUEST, **switches) -> dict:
    """What a start of the job plans with (rank 0's look-up), when nothing needs measuring."""
    found = replan.look_up(cache, request, replan.Switches(**switches), Phases())
    assert found.plan is not None
    return found.plan.to_json()


def self_check(cache: Entry) -> CalibrationRecord:
    """What the self-check of the cached plan stores: the truth's times, fitted."""
    cached = cache.read(PLAN)
    layout, placement = cached.best.layout, cached.best.placement
    cluster, profile = cpu_like(), profile_from_json(PROFILE_DOC)
    samples = samples_where(calibrated(cluster, profile, TRUTH), resolve_job(TINY, layout), placement)
    check = compare(cached.best.iteration_time_s, cached.best.memory.stages, samples, (2, 6))
    fitted = fit(TINY, cluster, profile, layout, placement, check)
    calibration = CalibrationRecord.of(fitted, layout, placement, check)
    cache.write(CALIBRATION, calibration.to_json())
    return calibration


def describe(doc: dict) -> str:
    return chosen(doc)[0].describe()


def test_a_cached_probe_is_planned_from_without_probing(cache: Entry, capsys) -> None:
    doc = start(cache)
    assert "planning from the probe and layer profile cached in" in capsys.readouterr().out
    assert cache.read(PLAN).to_json() == json.loads(json.dumps(doc)) and "calibration" not in doc
    assert describe(doc) == "tp1 pp1 dp4 mbs4 dopt+opg"


def test_a_calibration_is_reported_and_the_layout_kept_unless_asked(cache: Entry, capsys) -> None:
    """The truth's links are 100x slower: the calibrated model predicts the cached layout at the
    measured time and finds a pipeline layout faster, but keeps the cached one by default."""
    start(cache)
    calibration = self_check(cache)
    capsys.readouterr()
    doc = start(cache)
    out = capsys.readouterr().out
    assert "calibrated model: compute x0.5, memory-bound work x1, intra-node links x0.01 of the modelled rates" in out
    assert describe(doc) == "tp1 pp1 dp4 mbs4 dopt+opg"
    assert doc["candidates"][0]["iteration_time_s"] == pytest.approx(calibration.fitted_on.measured_s)
    assert "the calibrated model's best is tp1 pp4 dp1" in out
    assert "keeping the cached layout; --auto-parallel-replan-if-slower PCT switches" in out
    assert doc["calibration"]["id"] == calibration.id
    again = start(cache)
    assert again == json.loads(json.dumps(doc)) and "using the plan in" in capsys.readouterr().out


@pytest.mark.parametrize("pct, switched", [(5.0, True), (95.0, False)])
def test_replan_if_slower_switches_past_its_threshold(cache: Entry, capsys, pct: float, switched: bool) -> None:
    start(cache)
    self_check(cache)
    doc = start(cache, replan_if_slower=pct)
    out = capsys.readouterr().out
    best = calibrated(cpu_like(), profile_from_json(PROFILE_DOC), TRUTH)
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
                                           r"given \(1 rejected: --tensor-model-parallel-size N does not divide "
                                           r"the N GPUs\)"):
        start(cache, JobRequest(workload=TINY, world_size=4, gpus_per_node=4,
                                typed={**CONSTRAINTS, "tensor_model_parallel_size": 3}))
