"""Plans and estimates as JSON documents, and the plan document's record (PlanRecord; callers do the I/O).

The same document is what `pipette plan --json` prints, what the in-job hook
writes beside the checkpoint, and what `--auto-parallel-plan-file` pins.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_pipette.calibration.check import CheckResult, StageCheck
from megatron_pipette.calibration.document import CalibrationRef
from megatron_pipette.cost.memory import MemoryEstimate, StageMemory
from megatron_pipette.cost.timing import TimeEstimate
from megatron_pipette.errors import PipetteError
from megatron_pipette.plan.placement import Placement
from megatron_pipette.plan.planner import Candidate, Plan
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import Workload

SCHEMA = "megatron-pipette/plan"
VERSION = 1


def memory_json(memory: MemoryEstimate) -> dict[str, Any]:
    return {
        "capacity_bytes": memory.capacity_bytes,
        "peak_bytes": memory.peak_bytes,
        "fits": memory.fits,
        "tight": memory.tight,
        "stages": [{**dataclasses.asdict(s), "peak_bytes": s.total_bytes} for s in memory.stages],
    }


def estimate_json(layout: Layout, time: TimeEstimate, memory: MemoryEstimate) -> dict[str, Any]:
    """An estimate as JSON; "extrapolations" (what the layer profile was used for beyond what it
    measured) only where there are some, so estimates without a profile read as before."""
    doc = {
        "layout": dataclasses.asdict(layout),
        "megatron_args": layout.megatron_args(),
        "iteration_time_s": time.iteration_time_s,
        "tflops_per_gpu": time.tflops_per_gpu,
        "breakdown_s": time.breakdown.as_dict(),
        "memory": memory_json(memory),
    }
    if time.extrapolations:
        doc["extrapolations"] = list(time.extrapolations)
    return doc


def candidate_json(c: Candidate) -> dict[str, Any]:
    return {
        **estimate_json(c.layout, c.time, c.memory),
        "default_order_time_s": c.default_order_time_s,
        "simulated_time_s": c.simulated_time_s,
        "placement": {"node_order": list(c.placement.node_order),
                      "gpus_per_node": c.placement.gpus_per_node},
    }


def plan_json(result: Plan) -> dict[str, Any]:
    """What `pipette plan --json` prints: the plan's record, without a job's phases or calibration."""
    return PlanRecord.from_plan(result).to_json()


@dataclass(frozen=True)
class CandidateRecord:
    """A candidate of a plan document, as its readers use it. `document` is the candidate as written:
    it is written back as it was, and identifies the candidate (`digest`)."""

    layout: Layout
    placement: Placement
    iteration_time_s: float
    memory: MemoryEstimate
    document: Mapping[str, Any]
    extrapolations: tuple[str, ...] = ()
    """What its estimate took from the layer profile beyond what it measured (absent in older plans)."""

    def digest(self) -> str:
        """Identifies the candidate: ranks agree on it, the self-check finds it again."""
        return hashlib.sha256(json.dumps(self.document, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class PlanRecord:
    """A plan document (plan.json, the plan beside a checkpoint, `pipette plan --json`), typed. Its one
    reader is `from_json`, its one writer `to_json`."""

    model: Workload
    """The model planned for (a plan for another model is told apart field by field)."""
    cluster: str
    world_size: int
    considered: int
    out_of_memory: int
    candidates: tuple[CandidateRecord, ...]
    """Best first; never empty."""
    phases_s: Mapping[str, float] | None = None
    """Seconds per phase of the start that made it (the in-job hook's plans)."""
    calibration: CalibrationRef | None = None
    self_check: CheckResult | None = None
    """What a self-check measured of it."""

    @property
    def best(self) -> CandidateRecord:
        return self.candidates[0]

    @classmethod
    def from_plan(cls, result: Plan, phases_s: Mapping[str, float] | None = None,
                  calibration: CalibrationRef | None = None) -> PlanRecord:
        candidates = tuple(CandidateRecord(c.layout, c.placement, c.time.iteration_time_s, c.memory, candidate_json(c),
                                           c.time.extrapolations) for c in result.candidates)
        return cls(model=result.workload, cluster=result.cluster_name,
                   world_size=result.world_size, considered=result.considered, out_of_memory=result.out_of_memory,
                   candidates=candidates, phases_s=phases_s, calibration=calibration)

    def to_json(self) -> dict[str, Any]:
        doc = {"schema": SCHEMA, "version": VERSION, "model": workload_json(self.model), "cluster": self.cluster,
               "world_size": self.world_size, "considered": self.considered, "out_of_memory": self.out_of_memory,
               "candidates": [dict(c.document) for c in self.candidates]}
        if self.phases_s is not None:
            doc["phases_s"] = dict(self.phases_s)
        if self.calibration is not None:
            doc["calibration"] = self.calibration.to_json()
        if self.self_check is not None:
            doc["self_check"] = _check_json(self.self_check)
        return doc

    @classmethod
    def from_json(cls, doc: Any, where: str) -> PlanRecord:
        """The record of a plan document, checked whole (PipetteError naming `where` if it is not one)."""
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or doc.get("version") != VERSION:
            raise PipetteError(f"{where}: not a megatron-pipette plan (schema {SCHEMA} version {VERSION})")
        if not isinstance(doc.get("candidates"), list) or not doc["candidates"]:
            raise PipetteError(f"{where}: the plan has no candidate")
        if not isinstance(doc.get("model"), dict):
            raise PipetteError(f"{where}: the plan has no model")
        model = _model_from_json(doc["model"], where)
        check = None if doc.get("self_check") is None else _check_from_json(doc["self_check"], where)
        calibration = None if doc.get("calibration") is None else CalibrationRef.from_json(doc["calibration"], where)
        try:
            return cls(model=model, cluster=str(doc["cluster"]), world_size=int(doc["world_size"]),
                       considered=int(doc["considered"]), out_of_memory=int(doc["out_of_memory"]),
                       candidates=tuple(_candidate_from_json(c, where) for c in doc["candidates"]),
                       phases_s=doc.get("phases_s"), calibration=calibration, self_check=check)
        except (KeyError, TypeError, ValueError) as e:
            raise PipetteError(f"{where}: malformed plan ({e!r})") from None


def workload_json(workload: Workload) -> dict[str, Any]:
    """A plan document's model block: the workload's fields, word lists (--cuda-graph-modules) as JSON
    lists, so that a document reads back unchanged."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(workload).items()}


def _model_from_json(doc: dict[str, Any], where: str) -> Workload:
    try:
        return Workload(**doc)
    except (TypeError, ValueError, PipetteError) as e:
        raise PipetteError(f"{where}: malformed model ({e!r})") from None


def _check_json(check: CheckResult) -> dict[str, Any]:
    """A self-check as the plan holds it, with its time error and the stages over memory (read by
    people and benchmarks; _check_from_json derives them again)."""
    return {**dataclasses.asdict(check), "time_error": check.time_error,
            "over_memory": [{"stage": s.stage, "term": t} for s, t in check.over_memory()]}


def _check_from_json(doc: Any, where: str) -> CheckResult:
    try:
        first, last = doc["iterations"]
        return CheckResult(iterations=(int(first), int(last)), predicted_s=float(doc["predicted_s"]),
                           measured_s=float(doc["measured_s"]), forward_backward_s=float(doc["forward_backward_s"]),
                           stages=tuple(map(_stage_check_from_json, doc["stages"])),
                           missing_ranks=tuple(map(int, doc["missing_ranks"])), margin=float(doc["margin"]))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PipetteError(f"{where}: malformed self_check ({e!r})") from None


def _terms(doc: Any) -> dict[str, int] | None:
    return None if doc is None else {str(k): int(v) for k, v in doc.items()}


def _stage_check_from_json(doc: Any) -> StageCheck:
    """A stage of a self-check; one written before tensors were counted has neither tensor field
    (predicted_tensors then reads empty)."""
    measured_peak = doc["measured_peak_bytes"]
    return StageCheck(stage=int(doc["stage"]), ranks=int(doc["ranks"]), compute_s=float(doc["compute_s"]),
                      predicted_peak_bytes=int(doc["predicted_peak_bytes"]),
                      predicted_terms=_terms(doc["predicted_terms"]),
                      measured_peak_bytes=None if measured_peak is None else int(measured_peak),
                      measured_terms=_terms(doc["measured_terms"]),
                      predicted_tensors=_terms(doc.get("predicted_tensors")) or {},
                      measured_tensors=_terms(doc.get("measured_tensors")))


_STAGE_FIELDS = tuple(f.name for f in dataclasses.fields(StageMemory))


def _candidate_from_json(doc: Any, where: str) -> CandidateRecord:
    try:
        layout = Layout(**doc["layout"])
        placement = Placement(tuple(doc["placement"]["node_order"]), int(doc["placement"]["gpus_per_node"]))
        memory = doc["memory"]
        figures = [doc["iteration_time_s"], memory["peak_bytes"], memory["capacity_bytes"]]
        stages = tuple(StageMemory(**{k: s[k] for k in _STAGE_FIELDS if k in s}) for s in memory["stages"])
        extrapolations = doc.get("extrapolations", [])
    except (KeyError, TypeError, ValueError, PipetteError) as e:
        raise PipetteError(f"{where}: malformed candidate ({e})") from None
    if not isinstance(extrapolations, list) or not all(isinstance(line, str) for line in extrapolations):
        raise PipetteError(f"{where}: malformed candidate (extrapolations must list strings)")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in figures):
        raise PipetteError(f"{where}: malformed candidate (iteration_time_s and memory must be numbers)")
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in placement.node_order) \
            or placement.gpus_per_node <= 0:
        raise PipetteError(f"{where}: malformed candidate (node_order must list integers, gpus_per_node be "
                           f"positive)")
    return CandidateRecord(layout, placement, float(doc["iteration_time_s"]),
                           MemoryEstimate(stages=stages, capacity_bytes=memory["capacity_bytes"]), doc,
                           tuple(extrapolations))
