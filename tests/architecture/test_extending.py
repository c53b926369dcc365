"""docs/extending.md names real places: every backticked path exists, every dotted name under the
package (`spec.hardware.lookup_gpu`) is defined where it says, every `tests/...py::test_name` is a
test of that file, and no function outside the schedule modules compares a schedule's name (the page
says a new schedule is its own module and a line in the registry). Checked from the source (ast), so
no module is imported: a rename, a move or a new branch on a schedule's name fails here."""

import ast
import re
from functools import cache
from pathlib import Path

from megatron_pipette.cost.schedules import SCHEDULES

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_pipette"
DOC = ROOT / "docs" / "extending.md"
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
TOP_LEVEL = {p.stem for p in PACKAGE.glob("*.py")} | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
"""First parts of the package's dotted names: its subpackages and top-level modules."""


def spans(text: str) -> list[str]:
    """The page's inline code spans without spaces (names and paths, not command lines)."""
    return [s for s in re.findall(r"`([^`]*)`", text) if s and not any(c.isspace() for c in s)]


@cache
def module_tree(dotted: str) -> ast.Module | None:
    """The source of megatron_pipette.<dotted> (a module or a package's __init__), None if none."""
    base = PACKAGE.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return ast.parse(path.read_text())
    return None


def defined_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Functions, classes and assigned names (fields included) at one level of a module or class."""
    names = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def resolves(name: str) -> bool:
    """`module.name` or `module.Class.member` of the package is defined in its source."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        tree = module_tree(".".join(parts[:cut]))
        if tree is None:
            continue
        node: ast.AST = tree
        for part in parts[cut:]:
            body = getattr(node, "body", None)
            if not isinstance(body, list) or part not in defined_names(body):
                return False
            node = defined_names(body)[part]
        return True
    return False


def test_every_path_named_exists():
    paths = [s for s in spans(DOC.read_text()) if "/" in s and "::" not in s]
    assert paths, "the page names no paths: the parser is broken"
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_every_dotted_name_is_defined_where_it_says():
    names = [s for s in spans(DOC.read_text()) if DOTTED.fullmatch(s) and s.split(".")[0] in TOP_LEVEL]
    assert names, "the page names no code: the parser is broken"
    assert [n for n in names if not resolves(n)] == []


def test_every_test_named_is_a_test_of_its_file():
    tests = [s.split("::") for s in spans(DOC.read_text()) if "::" in s]
    assert tests, "the page names no tests: the parser is broken"
    missing = [f"{path}::{name}" for path, name in tests
               if not (ROOT / path).is_file() or name not in defined_names(ast.parse((ROOT / path).read_text()).body)]
    assert missing == []


def _compares_a_schedule_name(node: ast.AST) -> bool:
    """A comparison with a registered schedule's name among its operands (alone or in a tuple)."""
    for compare in (n for n in ast.walk(node) if isinstance(n, ast.Compare)):
        for operand in (compare.left, *compare.comparators):
            items = operand.elts if isinstance(operand, ast.Tuple | ast.List | ast.Set) else [operand]
            if any(isinstance(i, ast.Constant) and i.value in SCHEDULES for i in items):
                return True
    return False


def schedule_name_branches() -> set[str]:
    """`module.function` (or `module.Class.method`) of every function of the package that compares a
    schedule's name; nested functions count as the one around them."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for name, node in defined_names(ast.parse(path.read_text()).body).items():
            members = defined_names(node.body).items() if isinstance(node, ast.ClassDef) else [("", node)]
            for member, fn in members:
                if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and _compares_a_schedule_name(fn):
                    found.add(".".join(filter(None, (module, name, member))))
    return found


def test_only_the_schedule_modules_compare_schedule_names():
    """Timing, memory and the rest ask the Schedule object (cost.schedules.schedule_for); a branch on
    a schedule's name elsewhere is one more place a new schedule would have to change."""
    assert _compares_a_schedule_name(ast.parse('kind in ("1f1b", "x")')), "the scan is broken"
    assert {f for f in schedule_name_branches() if not f.startswith("cost.schedules.")} == set()
