"""In-job cluster probe: links inside and between nodes, per-device compute, in a time budget.

    from megatron_pipette.probe import run_probe
    probed = run_probe(budget_s=30, precision="bf16", small_bytes=4096,
                       large_bytes=64 * 2**20, repeats=5, out="cluster.json")

Standalone: `torchrun --nproc_per_node N -m megatron_pipette.probe --out cluster.json`.
The torch-dependent entry points load lazily so that the pure parts
(`schedule`, `budget`, `engine`, `fit`, `document`, `twin`) import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_pipette.probe.runner import run_probe

__all__ = ["run_probe"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from megatron_pipette.probe import runner
        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
