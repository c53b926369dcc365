"""Single-device layer profile: measured per-rank compute time and activation memory.

`profile_layers(workload, tp_sizes=..., micro_batch_sizes=...)` builds one Megatron
transformer layer (and the embedding and the output layer with its loss) with the
per-rank shapes of each tensor-parallel size, on one GPU or CPU, and measures
forward and backward time and the bytes each micro-batch keeps for backward. It
returns the layer-profile file, typed (`megatron_pipette.spec.layer_profile.ProfileFile`),
whose profile the planner uses in place of its roofline estimate. Standalone:
`pipette profile --model gpt3-1.3b --tp 1 2 4 --mbs 1 2 4 --out layer_profile.json`.
The torch-dependent entry point loads lazily so that the pure parts (`shapes`, `request`)
import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_pipette.profile.profiler import profile_layers

__all__ = ["profile_layers"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from megatron_pipette.profile import profiler
        return getattr(profiler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
