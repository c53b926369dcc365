"""The self-check as a picture: per pipeline stage, the plan's predictions against what was measured.

Why: the check's log gives one line for time and one for memory; a stage that runs slower than its
prediction, or holds more memory, stands out at once in a bar per stage. The in-job self-check
writes it beside its JSON (integration.selfcheck).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_pipette.calibration.check import TENSOR_TERMS, CheckResult
from megatron_pipette.calibration.fit import Fit
from megatron_pipette.report.figures import figure, png_bytes
from megatron_pipette.units import GiB, MiB

SIZE_IN = (12.0, 4.8)
COLORS = {"predicted": "C0", "uncalibrated model": "C0", "calibrated model": "C2", "measured": "C3", "counted": "C3"}
"""By what a series is: the model's predictions blue (calibrated green), measurements red."""


@dataclass(frozen=True, kw_only=True)
class Bar:
    """One bar of the chart."""

    panel: str
    """"time" or "memory"."""
    series: str
    """What the bar shows: "measured", "predicted", a model's prediction; memory series name their term."""
    stage: int
    value: float
    """Seconds (time) or the panel's memory unit; NaN: a stage none of whose ranks reported (not drawn)."""


def check_bars(check: CheckResult, fit: Fit | None) -> tuple[list[Bar], str]:
    """The chart's bars, and the memory panel's unit: per stage, the forward and backward passes per
    iteration measured and, with a calibration fit, as the uncalibrated and the calibrated model
    predict them; the peak memory predicted and measured (on a GPU) or, in CPU rehearsal, each
    tensor term predicted and counted."""
    bars = [Bar(panel="time", series="measured", stage=s.stage, value=s.compute_s) for s in check.stages]
    if fit is not None:
        for series, values in (("uncalibrated model", fit.predicted_passes_s),
                               ("calibrated model", fit.calibrated_passes_s)):
            bars += [Bar(panel="time", series=series, stage=s.stage, value=v) for s, v in zip(check.stages, values)]
    if any(s.measured_tensors is not None for s in check.stages):
        for term in TENSOR_TERMS:
            for s in check.stages:
                counted = math.nan if s.measured_tensors is None else s.measured_tensors[term] / MiB
                bars += [Bar(panel="memory", series=f"{term} predicted", stage=s.stage,
                             value=s.predicted_tensors[term] / MiB),
                         Bar(panel="memory", series=f"{term} counted", stage=s.stage, value=counted)]
        return bars, "MiB"
    for s in check.stages:
        measured = math.nan if s.measured_peak_bytes is None else s.measured_peak_bytes / GiB
        bars += [Bar(panel="memory", series="predicted", stage=s.stage, value=s.predicted_peak_bytes / GiB),
                 Bar(panel="memory", series="measured", stage=s.stage, value=measured)]
    return bars, "GiB"


def check_chart(check: CheckResult, fit: Fit | None) -> tuple[bytes, list[Bar]]:
    """The chart as PNG bytes (time per stage on the left, memory on the right, the iteration's
    predicted and measured time in the title), with the bars drawn."""
    bars, unit = check_bars(check, fit)
    fig = figure(*SIZE_IN)
    stages = [s.stage for s in check.stages]
    memory = f"peak memory ({unit})" if unit == "GiB" else f"tensors held ({unit})"
    panels = (("time", "forward + backward passes per iteration (s)"), ("memory", memory))
    for k, (panel, label) in enumerate(panels):
        ax = fig.add_subplot(1, 2, k + 1)
        mine = [b for b in bars if b.panel == panel]
        series = list(dict.fromkeys(b.series for b in mine))
        width = 0.8 / len(series)
        for i, name in enumerate(series):
            values = {b.stage: b.value for b in mine if b.series == name}
            kind = name if name in COLORS else name.rsplit(" ", 1)[1]      # "activations counted": counted
            ax.bar([s - 0.4 + width * (i + 0.5) for s in stages], [values[s] for s in stages], width,
                   label=name, color=COLORS[kind], edgecolor="white", hatch="//" if "activations" in name else None)
        ax.set_xticks(stages, [f"stage {s}" for s in stages])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    first, last = check.iterations
    fig.suptitle(f"self-check, iterations {first}-{last}: predicted {check.predicted_s:.3g} s/iteration, "
                 f"measured {check.measured_s:.3g} s ({check.time_error:+.1%})")
    fig.tight_layout()
    return png_bytes(fig), bars

