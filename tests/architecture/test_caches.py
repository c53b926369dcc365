"""Module-level caches in the planner (spec, cost, plan) are listed where cost.model says what is
cached and where: a new @cache, lru_cache or module-level memo that the list leaves out fails here."""

import ast
from pathlib import Path

import pytest

from megatron_pipette.cost import model

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_pipette"
PLANNER = ("spec", "cost", "plan")
CACHES = {"cache", "lru_cache"}
MEMOS = {"OrderedDict", "dict"}


def _decorator_name(node: ast.expr) -> str | None:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None


def module_level_caches() -> list[str]:
    """`layer.module.name` of every module-level function under @cache / @lru_cache and every
    module-level name bound to an empty dict or OrderedDict (a memo), in the planner (subpackages too)."""
    found = []
    for layer in PLANNER:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            parts = path.relative_to(PACKAGE).with_suffix("").parts
            prefix = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.FunctionDef) and any(_decorator_name(d) in CACHES
                                                             for d in node.decorator_list):
                    found.append(f"{prefix}.{node.name}")
                value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
                empty_call = (isinstance(value, ast.Call) and _decorator_name(value) in MEMOS
                              and not value.args and not value.keywords)
                if empty_call or (isinstance(value, ast.Dict) and not value.keys):
                    target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                    found.append(f"{prefix}.{target.id}")
    return found


def test_the_scan_finds_the_known_caches():
    caches = module_level_caches()
    assert {"cost.simulator.program_1f1b", "cost.interleaved._MEMO", "spec.hardware.gpu_catalog"} <= set(caches)


@pytest.mark.parametrize("name", module_level_caches())
def test_every_module_level_cache_is_listed_in_the_cost_model(name):
    module, function = name.rsplit(".", 1)
    listed = " ".join(model.__doc__.split())
    assert f"{module}.{function}" in listed or (module in listed and f" {function}" in listed), \
        f"{name} is cached at module level but cost.model's docstring does not list it"
