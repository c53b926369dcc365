"""Pictures without a display: matplotlib's Agg canvas, imported only when a picture is drawn, so
the planner and a plan without a picture never load matplotlib."""

from __future__ import annotations

import io
import os
import sys
from typing import Any

from megatron_pipette.files import write_atomic

DPI = 100


def load_matplotlib() -> None:
    """Import matplotlib for pictures written to files. Its import applies $MPLBACKEND and raises on a
    backend it cannot load (a notebook's module://matplotlib_inline..., outside the notebook; a
    misspelt one), though these pictures never use it: they are drawn on the Agg canvas. So the
    import does not see the variable; it is left as it was for the rest of the process."""
    if "matplotlib" in sys.modules:
        return
    backend = os.environ.pop("MPLBACKEND", None)
    try:
        import matplotlib  # noqa: F401
    finally:
        if backend is not None:
            os.environ["MPLBACKEND"] = backend


def figure(width_in: float, height_in: float) -> Any:
    """A matplotlib Figure of that size (DPI pixels an inch) on the Agg canvas."""
    load_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig: Any) -> bytes:
    """The figure as a PNG of exactly its size."""
    png = io.BytesIO()
    fig.savefig(png, format="png")
    return png.getvalue()


def write_png(fig: Any, path: str | os.PathLike, flag: str) -> None:
    """Write the figure as a PNG, atomically; a failure names `flag`."""
    write_atomic(path, png_bytes(fig), flag)
