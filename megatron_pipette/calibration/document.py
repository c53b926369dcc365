"""calibration.json, typed: the factors a self-check fitted, stored by allocation, and what they were
fitted on. Its one writer is `CalibrationRecord.to_json` (a record made by `of`, which merges a new
fit into the stored record), its one reader `CalibrationRecord.from_json`, which refuses factors
outside their physical bounds (fit.*_BOUNDS, fit.MAX_OVERHEAD_SHARE); the id, a hash of the rest,
tells a plan made with it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from megatron_pipette.calibration.check import CheckResult
from megatron_pipette.calibration.fit import (
    COMPUTE_BOUNDS,
    FACTOR_NAMES,
    LINK_BOUNDS,
    LINK_KINDS,
    MAX_OVERHEAD_SHARE,
    MEMORY_BOUNDS,
    Factors,
    Fit,
    merge,
)
from megatron_pipette.errors import PipetteError
from megatron_pipette.plan.placement import Placement
from megatron_pipette.spec.layout import Layout
from megatron_pipette.units import GiB

SCHEMA = "megatron-pipette/calibration"
VERSION = 1


@dataclass(frozen=True, kw_only=True)
class FittedOn:
    """The latest self-check a calibration was fitted on: its layout, node order, iterations and times
    (calibrated_s: that check's own fit's prediction), and the device memory."""

    layout: Layout
    node_order: tuple[int, ...]
    iterations: tuple[int, ...]
    measured_s: float
    predicted_s: float
    calibrated_s: float | None
    notes: tuple[str, ...]
    device_memory_bytes: int | None = None
    """The device memory of the cluster fitted on, which bounds the memory overhead (None: written
    before it was recorded)."""


@dataclass(frozen=True, kw_only=True)
class CalibrationRecord:
    """A calibration document, typed."""

    id: str
    factors: Factors
    fitted_on: FittedOn
    fits: Mapping[str, int]
    """How many self-checks each factor combines (fit.FACTOR_NAMES; a factor none measured is absent)."""

    @classmethod
    def of(cls, fit_: Fit, layout: Layout, placement: Placement, check: CheckResult,
           stored: CalibrationRecord | None = None) -> CalibrationRecord:
        """The record of a fit, merged with the allocation's `stored` record (fit.merge); its id hashes
        everything else, as written."""
        fitted_on = FittedOn(layout=layout, node_order=tuple(placement.node_order),
                             iterations=tuple(check.iterations), measured_s=fit_.measured_s,
                             predicted_s=fit_.predicted_s, calibrated_s=fit_.calibrated_s, notes=tuple(fit_.notes),
                             device_memory_bytes=fit_.device_memory_bytes)
        factors, fits = merge(Factors() if stored is None else stored.factors, {} if stored is None else stored.fits,
                              fit_)
        body = _body(factors, fitted_on, fits)
        return cls(id=hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16], factors=factors,
                   fitted_on=fitted_on, fits=fits)

    @property
    def combined(self) -> int:
        """The most self-checks any of its factors combines."""
        return max(self.fits.values(), default=1)

    def to_json(self) -> dict[str, Any]:
        return {**_body(self.factors, self.fitted_on, self.fits), "id": self.id}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> CalibrationRecord:
        """The record of a calibration document, checked whole; a malformed one names the file."""
        try:
            if doc["schema"] != SCHEMA or doc["version"] != VERSION:
                raise ValueError(f"not a {SCHEMA} version {VERSION} document")
            if not isinstance(doc["id"], str):
                raise ValueError("its id is not a string")
            factors, on = _factors_from_json(doc["factors"]), doc["fitted_on"]
            calibrated, device = on.get("calibrated_s"), on.get("device_memory_bytes")
            layout = on.get("layout")      # get: a plan's candidates have the key too (tests/architecture)
            if not isinstance(layout, dict):
                raise ValueError(f"fitted_on.layout is {layout!r}, not a layout")
            fitted_on = FittedOn(layout=Layout(**layout), node_order=tuple(on.get("node_order") or ()),
                                 iterations=tuple(on.get("iterations") or ()), measured_s=float(on["measured_s"]),
                                 predicted_s=float(on["predicted_s"]),
                                 calibrated_s=None if calibrated is None else float(calibrated),
                                 notes=tuple(map(str, on.get("notes") or ())),
                                 device_memory_bytes=None if device is None else int(device))
            # Written before the count was kept: one fit of each factor it holds.
            fits = {str(k): int(v) for k, v in (doc.get("fits") or dict.fromkeys(
                ("compute_rate", "memory_rate", *factors.link_bandwidth, "memory_overhead_bytes"), 1)).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PipetteError(f"{where}: malformed calibration ({e})") from None
        if not all(k in LINK_KINDS for k in factors.link_bandwidth):
            raise PipetteError(f"{where}: calibration links must be one of {', '.join(LINK_KINDS)}")
        if not all(k in FACTOR_NAMES and n >= 1 for k, n in fits.items()):
            raise PipetteError(f"{where}: calibration fits must count fits (1 or more) of {', '.join(FACTOR_NAMES)}")
        if problem := _out_of_bounds(factors, fitted_on.device_memory_bytes):
            raise PipetteError(f"{where}: {problem}: not a physical calibration")
        return cls(id=doc["id"], factors=factors, fitted_on=fitted_on, fits=fits)


@dataclass(frozen=True)
class CalibrationRef:
    """The calibration a plan was made with, as the plan document holds it: its id (tells whether the
    allocation's calibration is still the one planned with) and its factors (for whoever reads the plan)."""

    id: str
    factors: Factors

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "factors": _factors_json(self.factors)}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> CalibrationRef:
        """A plan's calibration; PipetteError naming `where` if it is malformed (no bounds: the plan
        records what it was made with)."""
        try:
            return cls(str(doc["id"]), _factors_from_json(doc["factors"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PipetteError(f"{where}: malformed calibration ({e!r})") from None


def _out_of_bounds(factors: Factors, device_memory_bytes: int | None) -> str | None:
    """Which factor is outside its physical bounds (fit.*_BOUNDS, fit.MAX_OVERHEAD_SHARE), if one is."""
    rates = [("compute", factors.compute_rate, COMPUTE_BOUNDS), ("memory-bound", factors.memory_rate, MEMORY_BOUNDS),
             *((f"{k.replace('_', '-')} link", v, LINK_BOUNDS) for k, v in factors.link_bandwidth.items())]
    for name, value, (lo, hi) in rates:
        if not lo <= value <= hi:     # NaN too
            return f"the {name} factor x{value:.3g} is outside x{lo:.3g}-x{hi:.3g}"
    overhead = factors.memory_overhead_bytes
    if overhead < 0 or (device_memory_bytes is not None and overhead > MAX_OVERHEAD_SHARE * device_memory_bytes):
        return (f"the memory overhead {overhead / GiB:+.2f} GiB per device is outside 0-{MAX_OVERHEAD_SHARE:.0%} of "
                "the device")
    return None


def _factors_json(factors: Factors) -> dict[str, Any]:
    return {**asdict(factors), "link_bandwidth": dict(factors.link_bandwidth)}


def _factors_from_json(doc: Any) -> Factors:
    return Factors(compute_rate=float(doc["compute_rate"]), memory_rate=float(doc["memory_rate"]),
                   link_bandwidth={str(k): float(v) for k, v in doc["link_bandwidth"].items()},
                   memory_overhead_bytes=int(doc["memory_overhead_bytes"]))


def _body(factors: Factors, on: FittedOn, fits: Mapping[str, int]) -> dict[str, Any]:
    return {"schema": SCHEMA, "version": VERSION, "factors": _factors_json(factors), "fits": dict(fits),
            "fitted_on": {"layout": asdict(on.layout), "node_order": list(on.node_order),
                          "iterations": list(on.iterations), "measured_s": on.measured_s,
                          "predicted_s": on.predicted_s, "calibrated_s": on.calibrated_s, "notes": list(on.notes),
                          "device_memory_bytes": on.device_memory_bytes}}
