"""Human-readable views of pipette documents (no torch): `pipette show` calls these."""

from megatron_pipette.report.cluster_report import summarize, write_heatmap

__all__ = ["summarize", "write_heatmap"]
