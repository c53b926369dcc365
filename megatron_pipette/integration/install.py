"""Wrap Megatron's argument handling so `--auto-parallel` plans before validate_args.

`install()` is idempotent and works for the supported megatron-core layouts:
0.18+ looks `validate_args` up in `megatron.training.arguments` when
`parse_and_validate_args` runs; 0.17's `initialize_megatron` imported it into
`megatron.training.initialize`. Both names are wrapped where present.
"""

from __future__ import annotations

import functools
import sys

from megatron_pipette.integration.options import add_auto_parallel_args


def _wrap_validate(original):
    if getattr(original, "_pipette", False):
        return original

    @functools.wraps(original)
    def validate_args(args, defaults={}):  # noqa: B006 (Megatron's own signature)
        if getattr(args, "auto_parallel", False):
            from megatron_pipette.integration.hook import auto_parallel

            auto_parallel(args, sys.argv[1:], args)
        return original(args, defaults)

    validate_args._pipette = True
    return validate_args


def _wrap_add_arguments(original):
    if getattr(original, "_pipette", False):
        return original

    @functools.wraps(original)
    def add_megatron_arguments(parser):
        return add_auto_parallel_args(original(parser))

    add_megatron_arguments._pipette = True
    return add_megatron_arguments


def install() -> None:
    """Patch whichever of Megatron's argument modules are imported."""
    arguments = sys.modules.get("megatron.training.arguments")
    if arguments is not None:
        arguments.validate_args = _wrap_validate(arguments.validate_args)
        arguments.add_megatron_arguments = _wrap_add_arguments(arguments.add_megatron_arguments)
    initialize = sys.modules.get("megatron.training.initialize")
    if initialize is not None and hasattr(initialize, "validate_args"):
        initialize.validate_args = _wrap_validate(initialize.validate_args)
