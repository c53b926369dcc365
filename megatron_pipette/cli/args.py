"""Command-line flags generated from the spec dataclasses, so flags and fields cannot drift.

Every Workload and Layout field becomes the Megatron flag of the same name
(`hidden_size` -> `--hidden-size`). Flags the user did not type are absent
from the parsed namespace (argparse.SUPPRESS), which is how the planner tells
a constraint from a default. Megatron's other flags, left over by argparse,
are judged by spec/megatron_flags.py: neutral ones are ignored, so a launch
line can be pasted; one the planner cannot price is an error naming it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import re
import typing
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from megatron_pipette.errors import PipetteError
from megatron_pipette.files import read_json
from megatron_pipette.spec.cluster_file import ClusterFile
from megatron_pipette.spec.hardware import Cluster, cluster_presets, nvls_disabled, preset_cluster
from megatron_pipette.spec.layer_profile import (
    LayerProfile,
    ProfileFile,
    check_profile_device,
    check_profile_matches,
)
from megatron_pipette.spec.layout import VIRTUAL_STAGES, Layout, virtual_stages_as_layers
from megatron_pipette.spec.megatron_flags import check_priced, flag_table
from megatron_pipette.spec.workload import (
    Workload,
    attention_backend_built,
    megatron_flag,
    model_presets,
    workload_fields,
    workload_from_preset,
)

DEFAULT_MODEL = "gpt3-13b"
DEFAULT_CLUSTER = "dgx-a100"
REQUIRED_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "global_batch_size")
NEGATIVE_FLAGS = {"add_bias_linear": "--disable-bias-linear", "bias_gelu_fusion": "--no-bias-gelu-fusion",
                  "bias_swiglu_fusion": "--no-bias-swiglu-fusion"}
LAYOUT_FLAG_FIELDS = [f for f in dataclasses.fields(Layout) if f.name != "data_parallel_size"]
PER_LAYER_FLAGS = ("cp_comm_type",)
"""Megatron takes one value per layer (or one for all); the Layout holds the one value."""


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field, used as its flag's help."""
    docs, body = {}, ast.parse(inspect.getsource(cls)).body[0].body
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            text = " ".join(after.value.value.split())
            docs[node.target.id] = re.sub(r"^--[\w-]+[:;] ", "", text).replace("%", "%%")
    return docs


@cache
def field_types(cls: type) -> dict[str, object]:
    """The dataclass's annotations, resolved once: resolving evaluates every string annotation, and
    main builds its parser on every call (the malformed-input tests call it 1,400 times)."""
    return typing.get_type_hints(cls)


class _TupleAction(argparse.Action):
    """Stores the words as a tuple: the dataclasses are frozen and hashed."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, tuple(values))


def _as_text(kind: object) -> object:
    """A Literal of choices is typed as text: the field's own check names the choices in its error."""
    return str if typing.get_origin(kind) is typing.Literal else kind


def _add_field(group, field: dataclasses.Field, hints: dict, cls: type) -> None:
    kind = _as_text(hints[field.name])
    doc = field_docs(cls).get(field.name, "")
    if kind is bool:
        if field.default is True:  # Megatron's switch for a default-on feature says what it turns off
            group.add_argument(NEGATIVE_FLAGS[field.name], dest=field.name, action="store_false",
                               default=argparse.SUPPRESS, help=doc)
        else:
            group.add_argument(megatron_flag(field.name), action="store_true", default=argparse.SUPPRESS, help=doc)
        return
    options = [kind] if typing.get_origin(kind) is tuple else \
        [_as_text(t) for t in typing.get_args(kind) if t is not type(None)] or [kind]
    if typing.get_origin(options[0]) is tuple:    # a list of words (--recompute-modules core_attn mlp)
        group.add_argument(megatron_flag(field.name), dest=field.name, type=str, nargs="*", action=_TupleAction,
                           default=argparse.SUPPRESS, metavar="STR", help=doc)
        return
    base = str if str in options else options[0]   # `int | str` (--moe-layer-freq): the field parses the text
    nargs = "+" if field.name in PER_LAYER_FLAGS else None
    group.add_argument(megatron_flag(field.name), dest=field.name, type=base, nargs=nargs, default=argparse.SUPPRESS,
                       metavar=base.__name__.upper(), help=doc)


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (Megatron-LM flags; --model picks a preset they override)")
    group.add_argument("--model", choices=sorted(model_presets()), default=argparse.SUPPRESS,
                       help=f"a named preset (default for `plan`: {DEFAULT_MODEL})")
    hints = field_types(Workload)
    for field in workload_fields():
        if field.name != "precision":
            _add_field(group, field, hints, Workload)
    precision = group.add_mutually_exclusive_group()
    for name in ("bf16", "fp16", "fp32"):
        precision.add_argument(f"--{name}", dest="precision", action="store_const", const=name,
                               default=argparse.SUPPRESS, help=f"train in {name}")


def add_layout_flags(parser: argparse.ArgumentParser, title: str) -> None:
    group = parser.add_argument_group(title)
    hints = field_types(Layout)
    for field in LAYOUT_FLAG_FIELDS:
        _add_field(group, field, hints, Layout)
    group.add_argument(megatron_flag(VIRTUAL_STAGES), dest=VIRTUAL_STAGES, type=int, default=argparse.SUPPRESS,
                       metavar="INT", help="model chunks per pipeline rank: Megatron's other spelling of "
                       "--num-layers-per-virtual-pipeline-stage, converted to it (needs "
                       "--pipeline-model-parallel-size)")


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument("--cluster", default=DEFAULT_CLUSTER, metavar="FILE_OR_PRESET",
                       help=f"a probed cluster JSON file or a preset: {', '.join(cluster_presets())} "
                            f"(default {DEFAULT_CLUSTER})")
    group.add_argument("--gpu", help="GPU catalog name, overriding the preset's")
    group.add_argument("--num-nodes", type=int, help="nodes, overriding the preset's")
    group.add_argument("--gpus-per-node", type=int, help="GPUs per node, overriding the preset's")
    group.add_argument("--layer-profile", metavar="FILE",
                       help="measured layer profile JSON (pipette profile) instead of the roofline")


def transformer_engine_layers(ns: argparse.Namespace) -> bool:
    """Whether the layers priced are Transformer Engine's: Megatron's --transformer-impl, as typed beside
    plan or estimate (its default, transformer_engine, when not)."""
    return getattr(ns, "transformer_impl", "transformer_engine") == "transformer_engine"


def workload_from_args(ns: argparse.Namespace, default_model: str | None,
                       required: tuple[str, ...] = REQUIRED_MODEL_FLAGS, **fallbacks) -> Workload:
    """The model the flags describe: a --model preset they override, or the flags alone (then
    `required` must all be given; `fallbacks` fill fields the caller does not need)."""
    given = {f.name: getattr(ns, f.name) for f in workload_fields() if hasattr(ns, f.name)}
    if not transformer_engine_layers(ns):
        given["attention_backend"] = attention_backend_built(given.get("attention_backend", "auto"), False)
    model = getattr(ns, "model", None)
    if model is None:
        typed = [n for n in required if n in given]
        if typed or default_model is None:
            missing = [megatron_flag(n) for n in required if n not in given]
            if missing:
                raise PipetteError(f"missing {', '.join(missing)} (or pick a preset with --model)")
            return Workload(**{**fallbacks, **given})
        model = default_model
    return workload_from_preset(model, **given)


def precision_note(ns: argparse.Namespace, workload: Workload) -> str:
    """Where the precision planned came from, when the user did not choose it: Megatron's default
    (a pasted launch line without --bf16 or --fp16 trains in fp32, and is planned so)."""
    return "" if hasattr(ns, "precision") or workload.name != "custom" else \
        " (Megatron's default: neither --bf16 nor --fp16 given)"


def split_megatron_flags(leftovers: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Argparse's leftover words as Megatron flags (argument name -> the words after the flag, or
    its `=value`) and the words that are not Megatron flags."""
    by_option = {option: name for name, options in flag_table().options.items() for option in options}
    given: dict[str, list[str]] = {}
    unknown, current = [], None
    for word in leftovers:
        if not word.startswith("--"):
            (unknown if current is None else given[current]).append(word)
            continue
        option, is_pair, value = word.partition("=")
        current = by_option.get(option)
        if current is None:
            unknown.append(word)
        elif is_pair:
            given[current], current = [value], None
        else:
            given[current] = []
    return given, unknown


def _megatron_value(words: list[str], default: object) -> object:
    """What Megatron would parse from the words after a flag, judged by its default: a switch
    changes the default, numbers compare as numbers, anything else as text."""
    if not words:
        return not default if isinstance(default, bool) else True
    sample = default[0] if isinstance(default, list) and default else default
    kind = type(sample) if isinstance(sample, int | float) and not isinstance(sample, bool) else str
    try:
        values = [kind(w) for w in words]
    except ValueError:
        values = list(words)
    return values if isinstance(default, list) or len(values) > 1 else values[0]


def check_megatron_flags(given: dict[str, list[str]]) -> None:
    """Raise PipetteError naming the Megatron flags the planner cannot price, and any that describe
    the model but have no pipette flag (the plan would silently ignore them)."""
    table = flag_table()
    unused = [table.flag(name) for name in given if name in table.modelled]
    if unused:
        raise PipetteError(f"{', '.join(unused)}: not a pipette flag; pipette plans from the model flags in --help")
    check_priced({name: _megatron_value(words, table.refused[name].default if name in table.refused else None)
                  for name, words in given.items()})


def layout_constraints(ns: argparse.Namespace, num_layers: int | None = None) -> dict:
    """The layout flags the user typed, as Layout field values; given the model's `num_layers`,
    --num-virtual-stages-per-pipeline-rank converted (spec.layout.virtual_stages_as_layers), else kept
    under its own name."""
    typed = {f.name: getattr(ns, f.name) for f in LAYOUT_FLAG_FIELDS if hasattr(ns, f.name)}
    check_priced({name: typed[name] for name in PER_LAYER_FLAGS if name in typed})
    typed = {name: value[0] if name in PER_LAYER_FLAGS else value for name, value in typed.items()}
    if hasattr(ns, VIRTUAL_STAGES):
        typed[VIRTUAL_STAGES] = getattr(ns, VIRTUAL_STAGES)
    return typed if num_layers is None else virtual_stages_as_layers(num_layers, typed)


def cluster_from_args(ns: argparse.Namespace, precision: str, env: Mapping[str, str] | None = None) -> Cluster:
    """The --cluster preset or file; a preset's NVLS follows the job's environment `env` (default:
    this process's; nvls_disabled)."""
    source = ns.cluster
    if source in cluster_presets():
        cluster = preset_cluster(source, num_nodes=ns.num_nodes, gpus_per_node=ns.gpus_per_node, gpu=ns.gpu,
                                 precision=precision)
        off = nvls_disabled(os.environ if env is None else env)
        return dataclasses.replace(cluster, nvls=False) if off else cluster
    try:
        exists = Path(source).exists()
    except OSError:
        exists = False
    if not exists:
        raise PipetteError(f"--cluster {source!r} is neither a preset ({', '.join(cluster_presets())}) nor a file")
    overrides = [megatron_flag(n) for n in ("gpu", "num_nodes", "gpus_per_node") if getattr(ns, n) is not None]
    if overrides:
        raise PipetteError(f"{', '.join(overrides)} cannot override a measured --cluster file")
    return ClusterFile.from_json(read_json(source, "--cluster"), where=f"--cluster {source}").cluster


def profile_from_args(ns: argparse.Namespace, workload: Workload, cluster: Cluster) -> LayerProfile | None:
    if not ns.layer_profile:
        return None
    where = f"--layer-profile {ns.layer_profile}"
    profile = ProfileFile.from_json(read_json(ns.layer_profile, "--layer-profile"), where=where).profile
    check_profile_matches(profile, workload, where=where)
    check_profile_device(profile, cluster, where=where)
    return profile
