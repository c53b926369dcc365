"""Planning on rank 0 from what the cache holds for an allocation, without probing again.

A start finds, in the allocation's cache directory (integration.common):

* a plan, and no calibration fitted since it was made: the plan is used as it is;
* a plan and a calibration its self-check fitted: the cached probe and layer profile are planned
  again with the calibrated model and the log says what changed. The cached layout stays (with its
  calibrated prediction, which its next self-check holds it to) unless
  --auto-parallel-replan-if-slower PCT lets a layout the calibrated model finds more than PCT%
  faster replace it: switching layouts reshards the checkpoint, so it is asked for;
* a probe and a layer profile but no plan (planning failed, or the plan was deleted to plan
  again): planned from them, with the calibration if there is one.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from megatron_pipette.calibration.fit import Factors, calibrated, factors_from_json
from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import PipetteError
from megatron_pipette.integration.common import CALIBRATION, CLUSTER, PLAN, PROFILE, Phases, log, write_json
from megatron_pipette.plan.planner import Candidate, Plan, evaluate, plan
from megatron_pipette.report.plan_document import chosen_from_json, plan_json
from megatron_pipette.report.plans import plan_report
from megatron_pipette.spec.cluster_file import cluster_from_json
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import profile_from_json
from megatron_pipette.spec.workload import Workload
from megatron_pipette.units import GiB

TOP_K = 5


def plan_and_write(workload: Workload, model: CostModel, constraints: dict[str, Any], cache: Path, phases: Phases,
                   calibration: dict | None = None) -> dict:
    """Plan, print the report, and cache the document (which names the calibration it used)."""
    result = phases.run("plan", lambda: plan(workload, model, constraints=constraints, top_k=TOP_K))
    if not result.candidates:
        cluster = model.cluster
        rejected = "; ".join(f"{n} rejected: {reason}" for reason, n in sorted(result.rejected.items(),
                                                                              key=lambda kv: -kv[1])[:3])
        if not result.considered:       # every layout was rejected before memory was asked
            raise PipetteError(f"no layout of this model is valid on {cluster.world_size} devices with the flags "
                               f"as given ({rejected or 'none enumerated'})")
        raise PipetteError(f"no layout of this model fits in {cluster.memory_bytes / GiB:.1f} GiB per device "
                           f"on {cluster.world_size} devices ({result.out_of_memory} of {result.considered} "
                           f"layouts are out of memory" + (f"; {rejected}" if rejected else "") + ")")
    return _write_plan(result, cache, phases, calibration)


def _write_plan(result: Plan, cache: Path, phases: Phases, calibration: dict | None) -> dict:
    print(plan_report(result), flush=True)
    doc = {**plan_json(result), "phases_s": phases.seconds}
    if calibration is not None:
        doc["calibration"] = {"id": calibration["id"], "factors": calibration["factors"]}
    write_json(cache / PLAN, doc, "--auto-parallel-cache-dir")
    return doc


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PipetteError(f"--auto-parallel-cache-dir: cannot read {path} ({e})") from None


def _calibrated_model(cache: Path, calibration: dict | None) -> CostModel:
    """The cached probe and profile, with the cached calibration's factors when there is one."""
    cluster = cluster_from_json(_read(cache / CLUSTER), str(cache / CLUSTER))
    profile = profile_from_json(_read(cache / PROFILE), str(cache / PROFILE))
    factors = Factors() if calibration is None else factors_from_json(calibration, str(cache / CALIBRATION))
    if calibration is not None:
        fitted = calibration["fitted_on"]
        log(f"calibrated model: {factors.describe()} (fitted on a self-check that measured {fitted['measured_s']:.3g} "
            f"s/iteration against {fitted['predicted_s']:.3g} s predicted)", 0)
    return calibrated(cluster, profile, factors)


def plan_from_cache(workload: Workload, constraints: dict[str, Any], cache: Path, key: str, phases: Phases) -> dict:
    """A plan from the cached probe and layer profile (rank 0)."""
    log(f"planning from the probe and layer profile cached in {cache} (allocation {key}); probe and profile "
        "skipped", 0)
    calibration = _read(cache / CALIBRATION) if (cache / CALIBRATION).exists() else None
    return plan_and_write(workload, _calibrated_model(cache, calibration), constraints, cache, phases, calibration)


def cached_plan(workload: Workload, constraints: dict[str, Any], replan_if_slower: float | None, cache: Path,
                key: str, phases: Phases) -> dict:
    """The cached plan, planned again if a calibration was fitted since (rank 0)."""
    doc = _read(cache / PLAN)
    calibration = _read(cache / CALIBRATION) if (cache / CALIBRATION).exists() else None
    if calibration is None or calibration.get("id") == doc.get("calibration", {}).get("id"):
        log(f"using the plan in {cache / PLAN} (allocation {key}); probe and profile skipped", 0)
        return doc
    if not (cache / CLUSTER).exists() or not (cache / PROFILE).exists():
        log(f"using the plan in {cache / PLAN} (allocation {key}) uncalibrated: the probe or layer profile it was "
            "made from is not cached", 0)
        return doc
    log(f"a self-check calibrated the model since {cache / PLAN} was made: planning again from the probe and "
        f"layer profile cached there (allocation {key})", 0)
    model = _calibrated_model(cache, calibration)
    result = phases.run("plan", lambda: plan(workload, model, constraints=constraints, top_k=TOP_K))
    layout, placement = chosen_from_json(doc, str(cache / PLAN))
    job = resolve_job(workload, layout)
    time, memory = evaluate(model, job, placement)
    kept = Candidate(layout=layout, placement=placement, time=time, memory=memory,
                     default_order_time_s=model.time(job).iteration_time_s)
    log(f"{layout.describe()}: predicted {time.iteration_time_s:.3g} s/iteration by the calibrated model, "
        f"{doc['candidates'][0]['iteration_time_s']:.3g} s before", 0)
    chosen = _choose(kept, result.best, replan_if_slower)
    others = [c for c in result.candidates if (c.layout, c.placement) != (chosen.layout, chosen.placement)]
    return _write_plan(replace(result, candidates=(chosen, *others)[:TOP_K]), cache, phases, calibration)


def _choose(kept: Candidate, best: Candidate | None, replan_if_slower: float | None) -> Candidate:
    """The cached layout, or the calibrated best where --auto-parallel-replan-if-slower allows; logged."""
    if best is None:
        log("the calibrated model fits no layout; keeping the cached one, which ran", 0)
        return kept
    if (best.layout, best.placement) == (kept.layout, kept.placement):
        log("the calibrated model keeps it as the best layout", 0)
        return best
    gain = 1 - best.time.iteration_time_s / kept.time.iteration_time_s
    log(f"the calibrated model's best is {best.layout.describe()}: {best.time.iteration_time_s:.3g} s/iteration, "
        f"{gain:.1%} faster", 0)
    if replan_if_slower is None:
        log("keeping the cached layout; --auto-parallel-replan-if-slower PCT switches when another is more than "
            "PCT% faster", 0)
        return kept
    if gain * 100 > replan_if_slower:
        log(f"switching to {best.layout.describe()} (--auto-parallel-replan-if-slower {replan_if_slower:g})", 0)
        return best
    log(f"keeping the cached layout: not more than {replan_if_slower:g}% faster "
        "(--auto-parallel-replan-if-slower)", 0)
    return kept
