"""`pipette`: plan, estimate, probe, profile and show.

    pipette plan                                   # built-in default: GPT-3 13B on 4 DGX A100 nodes
    pipette plan --model gpt3-175b --cluster dgx-a100 --num-nodes 128
    pipette estimate --model gpt3-175b --num-nodes 128 \\
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
    torchrun --nnodes 4 --nproc_per_node 8 ... -m megatron_pipette.probe --out cluster.json
    pipette show cluster.json --heatmap links.png
    pipette profile --model gpt3-1.3b --tp 1 2 4 --mbs 1 2 4 --out layer_profile.json
    pipette compare layer_profile.json --gpu H100-80GB
    pipette probe-sim --truth truth.json --world-size 8192 --gpus-per-node 8 --budget-s 30 --out probed.json
    pipette estimate --cluster truth.json --plan plan.json
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys

from megatron_pipette import __version__
from megatron_pipette.cli import measuring, planning
from megatron_pipette.cli.args import check_megatron_flags, split_megatron_flags
from megatron_pipette.errors import PipetteError

EXIT_USAGE = 2
EXIT_OUTPUT = 1
"""The output could not be written (a full disk, a quota): one line, and this status."""
EXIT_CLOSED_OUTPUT = 1
"""The reader of the output went away (a closed pipe): quietly, with the status Python's own
handling of EPIPE gives."""
OUTPUT_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})
"""Errors of a write to stdout that are the output's, not pipette's (they carry no file name)."""


def one_line(message: str) -> str:
    """A message as one line of text: a value typed with a newline or a control character in it
    must not break the one-line error."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


NEMO_FLAGS = {
    "--virtual-pipeline-model-parallel-size":
        "--virtual-pipeline-model-parallel-size is NeMo's name; Megatron-LM takes "
        "--num-layers-per-virtual-pipeline-stage N (transformer layers per virtual stage: layers / (PP x VP))",
}
"""Flags NeMo users type that Megatron-LM spells otherwise: a pointer to Megatron's flag instead of
'unrecognized arguments'."""


class Parser(argparse.ArgumentParser):
    """argparse, with Megatron's rule that flags are never abbreviated (a pasted Megatron flag must
    not be read as a prefix of a pipette one) and its errors on one line (no usage block)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pipette", description=__doc__.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--version", action="version", version=f"megatron-pipette {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (planning.add_plan_parser, planning.add_estimate_parser, measuring.add_probe_parser,
                measuring.add_profile_parser, measuring.add_compare_parser, measuring.add_probe_sim_parser,
                measuring.add_show_parser):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, leftovers = parser.parse_known_args(argv)
    megatron, unknown = (split_megatron_flags(leftovers) if ns.command in ("plan", "estimate")
                         else ({}, leftovers))
    nemo = [word for word in unknown if word.split("=")[0] in NEMO_FLAGS]
    if nemo:
        parser.error(NEMO_FLAGS[nemo[0].split("=")[0]])
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        check_megatron_flags(megatron)
        if megatron.get("transformer_impl"):   # Megatron's layer spec decides the attention built
            ns.transformer_impl = megatron["transformer_impl"][0]
        code = ns.run(ns)
        sys.stdout.flush()      # a closed pipe or a full disk may say so only here
        return code
    except PipetteError as e:
        print(f"pipette {ns.command}: error: {one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:     # `pipette plan | head -1`: the reader has what it wanted
        _discard_stdout()
        return EXIT_CLOSED_OUTPUT
    except OSError as e:
        if e.errno not in OUTPUT_ERRORS or e.filename is not None:
            raise
        _discard_stdout()
        with contextlib.suppress(OSError):
            print(f"pipette {ns.command}: error: cannot write the output: {e.strerror}", file=sys.stderr)
        return EXIT_OUTPUT


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that what is still buffered does not fail again (with a
    traceback) when the interpreter flushes it at exit: Python's advice for SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
