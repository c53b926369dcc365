"""calibration.json, typed: the factors a self-check fitted, stored by allocation, and what they were
fitted on. Its one writer is `CalibrationRecord.to_json` (a record made by `of`), its one reader
`CalibrationRecord.from_json`; the id, a hash of the rest, tells a plan made with it."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from megatron_pipette.calibration.check import CheckResult
from megatron_pipette.calibration.fit import LINK_KINDS, Factors, Fit
from megatron_pipette.errors import PipetteError
from megatron_pipette.plan.placement import Placement
from megatron_pipette.spec.layout import Layout

SCHEMA = "megatron-pipette/calibration"
VERSION = 1


@dataclass(frozen=True, kw_only=True)
class FittedOn:
    """The self-check a calibration was fitted on: its layout (as written), node order, iterations and times."""

    layout: Mapping[str, Any]
    node_order: tuple[int, ...]
    iterations: tuple[int, ...]
    measured_s: float
    predicted_s: float
    calibrated_s: float | None
    notes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class CalibrationRecord:
    """A calibration document, typed."""

    id: str
    factors: Factors
    fitted_on: FittedOn

    @classmethod
    def of(cls, fit_: Fit, layout: Layout, placement: Placement, check: CheckResult) -> CalibrationRecord:
        """The record of a fit; its id hashes everything else, as written."""
        fitted_on = FittedOn(layout=asdict(layout), node_order=tuple(placement.node_order),
                             iterations=tuple(check.iterations), measured_s=fit_.measured_s,
                             predicted_s=fit_.predicted_s, calibrated_s=fit_.calibrated_s, notes=tuple(fit_.notes))
        body = _body(fit_.factors, fitted_on)
        return cls(id=hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16], factors=fit_.factors,
                   fitted_on=fitted_on)

    def factors_json(self) -> dict[str, Any]:
        """The factors as the document writes them (a plan made with this calibration carries them too)."""
        return _factors_json(self.factors)

    def to_json(self) -> dict[str, Any]:
        return {**_body(self.factors, self.fitted_on), "id": self.id}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> CalibrationRecord:
        """The record of a calibration document, checked whole; a malformed one names the file."""
        try:
            if doc["schema"] != SCHEMA or doc["version"] != VERSION:
                raise ValueError(f"not a {SCHEMA} version {VERSION} document")
            if not isinstance(doc["id"], str):
                raise ValueError("its id is not a string")
            f, on = doc["factors"], doc["fitted_on"]
            factors = Factors(compute_rate=float(f["compute_rate"]), memory_rate=float(f["memory_rate"]),
                              link_bandwidth={str(k): float(v) for k, v in f["link_bandwidth"].items()},
                              memory_overhead_bytes=int(f["memory_overhead_bytes"]))
            calibrated = on.get("calibrated_s")
            fitted_on = FittedOn(layout=dict(on.get("layout") or {}), node_order=tuple(on.get("node_order") or ()),
                                 iterations=tuple(on.get("iterations") or ()), measured_s=float(on["measured_s"]),
                                 predicted_s=float(on["predicted_s"]),
                                 calibrated_s=None if calibrated is None else float(calibrated),
                                 notes=tuple(map(str, on.get("notes") or ())))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PipetteError(f"{where}: malformed calibration ({e})") from None
        if not all(k in LINK_KINDS for k in factors.link_bandwidth) or \
                not all(v > 0 and math.isfinite(v) for v in (factors.compute_rate, factors.memory_rate,
                                                            *factors.link_bandwidth.values())):
            raise PipetteError(f"{where}: calibration factors must be positive, and links one of "
                               f"{', '.join(LINK_KINDS)}")
        return cls(id=doc["id"], factors=factors, fitted_on=fitted_on)


def _factors_json(factors: Factors) -> dict[str, Any]:
    return {**asdict(factors), "link_bandwidth": dict(factors.link_bandwidth)}


def _body(factors: Factors, on: FittedOn) -> dict[str, Any]:
    return {"schema": SCHEMA, "version": VERSION, "factors": _factors_json(factors),
            "fitted_on": {"layout": dict(on.layout), "node_order": list(on.node_order),
                          "iterations": list(on.iterations), "measured_s": on.measured_s,
                          "predicted_s": on.predicted_s, "calibrated_s": on.calibrated_s, "notes": list(on.notes)}}
