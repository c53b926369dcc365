"""Megatron's list expressions (`--moe-layer-freq "([0]+[1]*23)"`), evaluated within bounds.

Megatron-LM evaluates them with Python's `eval` behind a character filter (training/arguments.py,
_eval_pattern) that lets `**` through, so `[1]*9**9**9` runs for ever and `[1]*10**20` fills the
memory; the same text reaches the planner from a launch line, a plan document or a cache. This
reads the grammar the filter admits (integers, lists of integers, +, *, ** and parentheses) from
Python's own parse tree, and refuses a list longer than the caller's bound or an integer above
MAX_INTEGER before computing it, so any text ends in a value or a PipetteError at once.
"""

from __future__ import annotations

import ast
import math
from typing import Any

from megatron_pipette.errors import PipetteError

MAX_TEXT = 4096
"""Characters of an expression: a layer pattern spelt out entry by entry stays far below."""
MAX_INTEGER = 1 << 20
"""The largest integer an expression may compute (a repeat count, an exponent's result)."""
MAX_EXPONENT = 64
MAX_DEPTH = 256
"""Operations nested in one expression ("[0]+[1]+..." spelt out for 256 layers). An explicit bound,
far below any interpreter's recursion limit, so the answer never depends on what that limit is."""


def list_expression(text: str, *, max_length: int, flag: str) -> list[int]:
    """The list of integers `text` spells, e.g. "([0]+[1]*3)*2" -> [0, 1, 1, 1, 0, 1, 1, 1]; a
    PipetteError naming `flag` if it is not one or would hold more than `max_length` entries."""
    if len(text) > MAX_TEXT:
        raise PipetteError(f"{flag}: an expression of {len(text)} characters is longer than {MAX_TEXT}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
        value = _value(tree.body, max_length, MAX_DEPTH)
    except (SyntaxError, ValueError, MemoryError, RecursionError):   # the last: a limit set below ~MAX_DEPTH
        value = None
    except _Refused as e:
        raise PipetteError(f"{flag} {shown(text)}: {e}") from None
    if not isinstance(value, list):
        raise PipetteError(f"{flag} {shown(text)}: not a list expression of integers, +, * and parentheses "
                           f"such as \"([0]+[1]*3)\"")
    return value


def in_range(value: Any, low: float, high: float = math.inf, *, above: bool = False) -> bool:
    """A finite number (not a bool) in [low, high], or (low, high] with `above`; an integer too large
    for a float is out of range, not an error."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        number = float(value)
    except OverflowError:
        return False
    return math.isfinite(number) and (number > low if above else number >= low) and number <= high


def shown(value: object, limit: int = 60) -> str:
    """A value for a one-line message: text as typed, cut to `limit` characters."""
    if isinstance(value, int) and value.bit_length() > 4 * limit:     # repr() refuses 4,300 digits and more
        return f"an integer of {value.bit_length()} bits"
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class _Refused(Exception):
    """Why an expression is outside the bounds (caught and reworded by list_expression)."""


def _value(node: ast.AST, max_length: int, depth: int) -> int | list[int]:
    if depth == 0:
        raise _Refused(f"operations nested more than {MAX_DEPTH} deep")
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _integer(node.value)
    if isinstance(node, ast.List):
        items = [_value(e, max_length, depth - 1) for e in node.elts]
        if any(isinstance(x, list) for x in items):
            raise _Refused("a list of lists is not a layer pattern")
        return _length(items, len(items), max_length)
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult | ast.Pow)):
        raise _Refused("only integers, lists of integers, +, *, ** and parentheses are allowed")
    left, right = _value(node.left, max_length, depth - 1), _value(node.right, max_length, depth - 1)
    if isinstance(left, int) and isinstance(right, int):
        if isinstance(node.op, ast.Pow):
            if right < 0 or (abs(left) > 1 and right > MAX_EXPONENT):
                raise _Refused(f"{left}**{right} is not an integer up to {MAX_INTEGER}")
            return _integer(left ** right)
        return _integer(left + right if isinstance(node.op, ast.Add) else left * right)
    if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
        return _length(left, len(left) + len(right), max_length) + right
    if isinstance(node.op, ast.Mult):
        items, times = (left, right) if isinstance(left, list) else (right, left)
        if isinstance(times, int):
            return _length(items, len(items) * max(times, 0), max_length) * times
    raise _Refused("+ joins two lists, * repeats a list an integer number of times")


def _integer(value: int) -> int:
    if abs(value) > MAX_INTEGER:
        raise _Refused(f"an integer above {MAX_INTEGER}")
    return value


def _length(items: list[int], length: int, max_length: int) -> list[int]:
    """`items`, once the list about to be built from it is known to hold at most max_length entries."""
    if length > max_length:
        raise _Refused(f"a list of {length} entries, more than the {max_length} expected")
    return items
