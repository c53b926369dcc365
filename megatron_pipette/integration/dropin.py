"""What an unmodified Megatron-LM launch beside the pip-installed megatron-core needs, supplied by
the `--auto-parallel` hook (found running Megatron-LM's own pretrain_gpt.py as a new user would).

* The megatron-core wheel ships the dataset index helpers compiled (`helpers_cpp`) but no
  Makefile, and `initialize_megatron` runs `make` in megatron/core/datasets on rank 0, which
  fails and exits: a prebuilt helper is used as it is.
* In CPU rehearsal, the settings docs/cpu-rehearsal.md asks every CPU user for, where the command
  line leaves them out: gloo (NCCL needs GPUs), the local layer spec without Transformer Engine,
  neither persistent layer norm nor gradient-accumulation fusion without Apex or Transformer
  Engine, and CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron asserts for tensor parallelism on the
  Hopper the rehearsal pretends to be.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def use_prebuilt_dataset_helpers() -> None:
    """Skip `make` of the dataset index helpers where they ship prebuilt without a Makefile."""
    from megatron.core.datasets import utils as datasets_utils

    if (Path(datasets_utils.__file__).parent / "Makefile").exists():
        return
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return  # neither built nor buildable: Megatron's own error says so
    datasets_utils.compile_helpers = _prebuilt


def _prebuilt() -> None:
    """Stands in for `compile_helpers`: the wheel's helpers_cpp is already built."""


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def cpu_rehearsal_settings(args: Any, argv: Sequence[str]) -> list[str]:
    """Set what a CPU rehearsal needs and the command line left out; describe each change."""
    typed = {token.split("=", 1)[0] for token in argv}
    changed = []
    if args.distributed_backend != "gloo":
        changed.append(f"--distributed-backend gloo (not {args.distributed_backend}: NCCL needs GPUs)")
        args.distributed_backend = "gloo"
    te = _installed("transformer_engine")
    if "--transformer-impl" not in typed and args.transformer_impl == "transformer_engine" and not te:
        changed.append("--transformer-impl local (Transformer Engine is not installed)")
        args.transformer_impl = "local"
    if not (te or _installed("apex")):
        if not args.no_persist_layer_norm:
            changed.append("--no-persist-layer-norm")
            args.no_persist_layer_norm = True
        if args.gradient_accumulation_fusion:
            changed.append("--no-gradient-accumulation-fusion")
            args.gradient_accumulation_fusion = False
    if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        changed.append("CUDA_DEVICE_MAX_CONNECTIONS=1")
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return changed
