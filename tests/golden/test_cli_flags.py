"""Every `pipette` subcommand's flags, frozen: a rename or a removal is a deliberate change of this
file (regenerate with PIPETTE_REGENERATE_GOLDEN=1), never a slip users find in their scripts."""

import argparse
import json
import os
from pathlib import Path

from megatron_pipette.cli.main import build_parser

GOLDEN = Path(__file__).with_name("cli_flags.json")


def subcommand_flags() -> dict[str, list[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {}
    for name, command in sub.choices.items():
        options = [s for action in command._actions for s in action.option_strings if s not in ("-h", "--help")]
        positionals = [action.dest for action in command._actions if not action.option_strings]
        flags[name] = sorted(options) + [f"<{p}>" for p in positionals]
    return flags


def test_subcommand_flags_are_frozen():
    got = json.dumps(subcommand_flags(), indent=1, sort_keys=True) + "\n"
    if os.environ.get("PIPETTE_REGENERATE_GOLDEN") == "1":
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text(), f"pipette's flags changed; diff against {GOLDEN.name}"
