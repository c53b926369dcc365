"""Make `--auto-parallel` available to unmodified Megatron scripts (loaded by a .pth file).

Python imports this at start-up through `megatron_pipette_autoload.pth` in
site-packages. It costs nothing unless the command line has `--auto-parallel`
(or PIPETTE_AUTO_PARALLEL=1): then it arranges that, when Megatron's
`megatron.training.arguments` (or, in megatron-core 0.17, `.initialize`) is
imported, its parser learns the flags and its `validate_args` runs the hook
first. No torch import happens here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

from megatron_pipette.integration.options import requested

TARGETS = ("megatron.training.arguments", "megatron.training.initialize")


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds Megatron's argument modules through the normal finders, then patches them once loaded."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                original_exec = loader.exec_module

                def exec_module(module, _exec=original_exec):
                    _exec(module)
                    from megatron_pipette.integration.install import install

                    install()

                loader.exec_module = exec_module
                return spec
        return None


def activate() -> None:
    if requested(sys.argv) and not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())


activate()
