"""Megatron-LM's arguments, by what the planner makes of them, so none is silently mis-planned.

data/megatron_flags.json puts every argument Megatron-LM parses (by its `args` name) in one
class: *modelled* (a Workload or Layout field, or read to build one), *refused* when set to
anything but Megatron's own default, with the reason (it changes time or memory per iteration
in a way the cost model does not describe: mixture-of-experts, context parallelism, FP8, ...),
or *neutral* (logging, paths, seeds, learning-rate schedule, ...). A few arguments are modelled
for some values only (ALLOWED_VALUES). tests/integration/test_megatron_parser.py holds the table
against Megatron's own parser, so a new Megatron release cannot add a flag unnoticed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.layout import CP_COMM_TYPES
from megatron_pipette.spec.workload import (
    ATTENTION_BACKENDS,
    FP8_RECIPES,
    MOE_DISPATCHERS,
    NORMALIZATIONS,
    POSITION_EMBEDDINGS,
    megatron_flag,
)

ALLOWED_VALUES: dict[str, tuple[str, ...]] = {
    "position_embedding_type": POSITION_EMBEDDINGS,
    "normalization": NORMALIZATIONS,
    "attention_backend": ATTENTION_BACKENDS,
    "transformer_impl": ("transformer_engine", "local"),
    "optimizer": ("adam",),
    "rerun_mode": ("validate_results", "disabled"),
    "moe_token_dispatcher_type": MOE_DISPATCHERS,
    "cp_comm_type": CP_COMM_TYPES,
    "fp8_recipe": FP8_RECIPES,
}
"""Arguments whose value decides: the model describes these values only (Adam's state, one
training step per iteration, Megatron's own layer implementations)."""


@dataclass(frozen=True)
class Refused:
    """A Megatron argument the model does not cover, harmless only at Megatron's default."""

    default: Any
    reason: str


@dataclass(frozen=True)
class Refusal:
    """One argument set to a value the planner cannot price."""

    flag: str
    value: Any
    reason: str

    def __str__(self) -> str:
        """`--num-experts 64: mixture-of-experts is not modelled yet` (a switch without its value)."""
        value = getattr(self.value, "name", self.value)
        if isinstance(value, bool):
            return f"{self.flag}: {self.reason}"
        shown = " ".join(map(str, value)) if isinstance(value, list) else value
        return f"{self.flag} {shown}: {self.reason}"


@dataclass(frozen=True)
class FlagTable:
    """data/megatron_flags.json, by argument name."""

    modelled: frozenset[str]
    refused: Mapping[str, Refused]
    neutral: frozenset[str]
    options: Mapping[str, tuple[str, ...]]
    """Every Megatron option string of each argument (`add_bias_linear`: `--disable-bias-linear`)."""

    def flag(self, name: str) -> str:
        """The option that sets this argument away from its default, as Megatron spells it."""
        return self.options[name][0]


# Module-level memo: package data, read once (a pure function of no argument).
@cache
def flag_table() -> FlagTable:
    doc = json.loads(resources.files("megatron_pipette.data").joinpath("megatron_flags.json").read_text())
    modelled = [n for names in doc["modelled"].values() for n in names]
    neutral = [n for names in doc["neutral"].values() for n in names]
    refused = {n: Refused(default, family["reason"]) for family in doc["refused"]
               for n, default in family["defaults"].items()}
    names = [*modelled, *refused, *neutral]
    assert len(names) == len(set(names)), "an argument is in two classes of megatron_flags.json"
    options = {n: tuple(doc["flags"].get(n, [megatron_flag(n)])) for n in names}
    return FlagTable(frozenset(modelled), refused, frozenset(neutral), options)


def refusals(values: Mapping[str, Any]) -> list[Refusal]:
    """The arguments among `values` (Megatron's `args` by name; absent ones are at their default)
    that the planner cannot price: refused ones set away from Megatron's default, and values
    outside ALLOWED_VALUES (an enum counts by its name)."""
    table, found = flag_table(), []
    for name, value in values.items():
        refused = table.refused.get(name)
        allowed = ALLOWED_VALUES.get(name)
        if allowed is not None and isinstance(value, list):   # --cp-comm-type: one entry per layer, or one
            if len(set(value)) > 1:
                found.append(Refusal(table.flag(name), value, "a type per layer is not modelled (one for all is)"))
                continue
            value = value[0]
        if refused is not None and value != refused.default:
            found.append(Refusal(table.flag(name), value, refused.reason))
        elif allowed is not None and getattr(value, "name", value) not in allowed:
            verb = "is" if len(allowed) == 1 else "are"
            found.append(Refusal(table.flag(name), value, f"only {', '.join(allowed)} {verb} modelled"))
    return found


def check_priced(values: Mapping[str, Any]) -> None:
    """Raise PipetteError naming every refusal among `values` (see refusals)."""
    refused = refusals(values)
    if refused:
        raise PipetteError("; ".join(map(str, refused)))
