"""The import direction docs/architecture.md states, checked on the source: a new import that runs
sideways or upwards (the hook importing the CLI, the cost model importing torch) fails here."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_pipette"
ALLOWED = {
    "errors": set(),
    "units": set(),
    "files": {"errors"},
    "data": set(),
    "spec": {"errors", "units", "data"},
    "cost": {"spec", "errors", "units"},
    "plan": {"cost", "spec", "errors", "units"},
    "report": {"plan", "cost", "calibration", "spec", "errors", "units", "files"},
    "calibration": {"plan", "cost", "spec", "errors", "units"},
    "measure": {"errors", "units"},
    "probe": {"spec", "measure", "errors", "units", "files"},
    "profile": {"spec", "measure", "errors", "units"},
    "integration": {"spec", "cost", "plan", "report", "calibration", "probe", "profile", "errors", "units", "files"},
    "cli": {"spec", "cost", "plan", "report", "probe", "profile", "errors", "units", "files"},
}
"""Layer -> the layers it may import (besides itself). Descriptions feed the cost model, which the
planner uses; reports present; calibration fits the measured inputs to a self-check with the cost
model; measurements produce inputs; reports present them all; the hook and the CLI sit on top."""
TORCH_FREE = {"errors", "units", "files", "spec", "cost", "plan", "report", "calibration"}
TORCH_FREE_MODULES = {"probe.schedule", "probe.budget", "probe.transport", "probe.engine", "probe.fit",
                      "probe.document", "probe.twin", "probe.options", "profile.shapes", "profile.request",
                      "cli.main", "cli.args", "cli.planning", "cli.measuring", "integration.cache",
                      "integration.plan_check", "integration.replan", "integration.common",
                      "integration.megatron_args"}
"""Modules outside the torch-free layers whose top-level imports must stay free of torch too (the
probe's logic runs in the twin; the CLI starts without torch and imports it only inside `probe`
and `profile`; the hook's cache, plan check and planning from the cache are tested without torch)."""
HEAVY = ("torch", "megatron")


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = rel.parts
        if parts == ("__init__",) or parts[-1] == "__main__":   # entry points: `python -m` shims over the CLI
            continue
        layer = parts[0]
        name = ".".join(p for p in parts if p != "__init__")
        yield layer, name, ast.parse(path.read_text(), str(path))


def imports(tree: ast.AST, top_level_only: bool):
    """(module imported, line) for every import; with top_level_only, not those inside functions."""
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
        elif top_level_only and isinstance(node, ast.If):   # `if TYPE_CHECKING:` blocks
            continue


def test_every_layer_is_known():
    assert {layer.split(".")[0] for layer, _, _ in modules()} <= set(ALLOWED)


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_point_one_way(layer):
    wrong = []
    for mod_layer, name, tree in modules():
        if mod_layer != layer:
            continue
        for target, line in imports(tree, top_level_only=False):
            if not target.startswith("megatron_pipette."):
                continue
            other = target.split(".")[1]
            if other != layer and other not in ALLOWED[layer]:
                wrong.append(f"megatron_pipette/{name.replace('.', '/')}.py:{line} imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_planner_and_the_probe_logic_import_no_torch():
    wrong = []
    for layer, name, tree in modules():
        whole_layer = layer in TORCH_FREE
        if not whole_layer and name not in TORCH_FREE_MODULES:
            continue
        for target, line in imports(tree, top_level_only=not whole_layer):
            if target.split(".")[0] in HEAVY:
                wrong.append(f"megatron_pipette/{name.replace('.', '/')}.py:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_matplotlib_is_imported_only_where_a_picture_is_drawn():
    """The planner (and calibration) never draws; everywhere else matplotlib is imported inside the
    function that draws, so `pipette plan` without a picture, and the hook, never load it."""
    wrong = []
    for layer, name, tree in modules():
        anywhere = layer in ("spec", "cost", "plan", "calibration")
        for target, line in imports(tree, top_level_only=not anywhere):
            if target.split(".")[0] == "matplotlib":
                wrong.append(f"megatron_pipette/{name.replace('.', '/')}.py:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_benchmarks_stay_outside_the_package_and_validation_never_imports_calibration():
    """The package never imports its evidence; the validation suite checks the package as shipped, so
    it imports no calibration step (calibration may price the development sets through it)."""
    benchmarks = PACKAGE.parent / "benchmarks"
    wrong = [f"megatron_pipette/{name.replace('.', '/')}.py:{line} imports {target}"
             for _, name, tree in modules() for target, line in imports(tree, top_level_only=False)
             if target.split(".")[0] == "benchmarks"]
    for path in sorted((benchmarks / "validation").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        wrong += [f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
                  for target, line in imports(tree, top_level_only=False)
                  if target.startswith("benchmarks.calibration")]
    assert not wrong, "\n".join(wrong)
