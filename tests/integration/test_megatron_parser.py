"""data/megatron_flags.json against the parser of the pinned Megatron-LM: every argument it parses
is classified exactly once, and the table names nothing Megatron does not parse. A new Megatron
release that adds an argument fails here until someone decides what the planner makes of it."""

import argparse
import dataclasses
import sys
import types

import pytest

from megatron_pipette.errors import PipetteError
from megatron_pipette.integration.options import add_auto_parallel_args
from megatron_pipette.spec.megatron_flags import ALLOWED_VALUES, flag_table, refusals

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def megatron_parser() -> argparse.ArgumentParser:
    return build_megatron_parser()


def build_megatron_parser() -> argparse.ArgumentParser:
    """Megatron's own argument parser, with the groups it adds only when an extension is installed
    (kitchen quantization), without process groups or the --auto-parallel flags."""
    kitchen = types.ModuleType("megatron.core.extensions.kitchen")
    kitchen.HAVE_KITCHEN, kitchen.KitchenSpecProvider = True, object
    saved = sys.modules.get(kitchen.__name__)
    sys.modules[kitchen.__name__] = kitchen
    try:
        from megatron.training import arguments

        add = getattr(arguments.add_megatron_arguments, "__wrapped__", arguments.add_megatron_arguments)
        parser = add(argparse.ArgumentParser(allow_abbrev=False))
    finally:
        if saved is None:
            del sys.modules[kitchen.__name__]
        else:
            sys.modules[kitchen.__name__] = saved
    ours = {a.dest for a in add_auto_parallel_args(argparse.ArgumentParser(add_help=False))._actions}
    assert not ours & {a.dest for a in parser._actions}, "the --auto-parallel flags leaked into Megatron's parser"
    return parser


def options_by_name(parser: argparse.ArgumentParser) -> dict[str, tuple[str, ...]]:
    options: dict[str, tuple[str, ...]] = {}
    for action in parser._actions:
        if action.dest != "help":
            options[action.dest] = options.get(action.dest, ()) + tuple(action.option_strings)
    return options


def test_every_megatron_argument_is_classified_once(megatron_parser):
    table = flag_table()
    parsed = set(options_by_name(megatron_parser))
    unclassified = parsed - table.modelled - table.neutral - set(table.refused)
    assert not unclassified, f"Megatron arguments missing from data/megatron_flags.json: {sorted(unclassified)}"
    stale = (table.modelled | table.neutral | set(table.refused)) - parsed
    assert not stale, f"data/megatron_flags.json names arguments Megatron does not parse: {sorted(stale)}"


def test_the_table_has_megatrons_options_and_defaults(megatron_parser):
    table = flag_table()
    assert {n: set(o) for n, o in options_by_name(megatron_parser).items()} == \
        {n: set(o) for n, o in table.options.items()}
    assert all(table.flag(n) in o for n, o in options_by_name(megatron_parser).items())
    defaults = vars(megatron_parser.parse_args([]))
    wrong = {n: (r.default, defaults[n]) for n, r in table.refused.items() if r.default != defaults[n]}
    assert not wrong, f"refused arguments whose default is not Megatron's: {wrong}"


def test_allowed_values_are_megatrons(megatron_parser):
    choices = {a.dest: a.choices for a in megatron_parser._actions if a.dest in ALLOWED_VALUES}
    for name, allowed in ALLOWED_VALUES.items():
        if choices[name] is not None:
            assert set(allowed) <= {getattr(c, "name", c) for c in choices[name]}, name


def test_megatrons_parsed_command_lines(megatron_parser):
    assert refusals(vars(megatron_parser.parse_args([]))) == []
    args = megatron_parser.parse_args(["--num-experts", "64", "--context-parallel-size", "2", "--lr", "3e-4",
                                       "--position-embedding-type", "mrope", "--no-overlap-p2p-communication",
                                       "--cp-comm-type", "a2a", "p2p", "--moe-shared-expert-gate"])
    assert sorted(r.flag for r in refusals(vars(args))) == [
        "--cp-comm-type", "--moe-shared-expert-gate", "--no-overlap-p2p-communication", "--position-embedding-type"]


def test_defaults_taken_from_the_environment_are_not_refused(monkeypatch):
    """Some defaults are read when the parser is built (--inprocess-active-world-size: WORLD_SIZE)."""
    for name, value in {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(name, value)
    assert refusals(vars(build_megatron_parser().parse_args([]))) == []


GPT_OSS_LIKE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512",
                "--quick-geglu", "--num-experts", "8", "--moe-router-topk", "2", "--position-embedding-type", "yarn",
                "--rotary-scaling-factor", "32", "--window-size", "127,0", "--window-attn-skip-freq", "[1,1,0,1]",
                "--softmax-type", "learnable",
                "--disable-bias-linear", "--activation-func-clamp-value", "7.0", "--glu-linear-offset", "1.0"]


def test_the_hook_reads_gpt_oss_attention_and_experts(megatron_parser):
    """Megatron parses --window-size into a tuple and a list skip pattern into a list; the hook's
    Workload prices the same windowed layers, sinks and gated experts."""
    from megatron_pipette.integration.megatron_args import workload_from_args

    args = megatron_parser.parse_args([*GPT_OSS_LIKE, "--vocab-size", "1000", "--global-batch-size", "8", "--bf16"])
    assert refusals(vars(args)) == []
    workload = workload_from_args(args)
    assert workload.window == 127 and workload.window_layer_pattern() == (True, True, False, True)
    assert workload.quick_geglu and workload.gated_linear_unit and workload.softmax_type == "learnable"
    assert workload.activation_func_clamp_value == 7.0


def test_yarns_concentration_factor_is_megatrons(megatron_parser):
    """What scales YaRN's cosines and sines (and so keeps Transformer Engine's fused RoPE out) is the
    factor megatron-core computes from the config training/argument_utils.py fills from the flags."""
    from types import SimpleNamespace

    from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config
    from megatron.training.argument_utils import _apply_yarn_config_from_args

    from megatron_pipette.integration.megatron_args import workload_from_args

    for extra in ([], ["--mscale", "0.7", "--mscale-all-dim", "0.3"], ["--rotary-scaling-factor", "1"]):
        args = megatron_parser.parse_args([*GPT_OSS_LIKE, *extra, "--vocab-size", "1000", "--global-batch-size", "8",
                                           "--bf16"])
        config = SimpleNamespace()
        _apply_yarn_config_from_args(config, args)
        assert workload_from_args(args).rope_concentration_factor == pytest.approx(
            _yarn_get_concentration_factor_from_config(config))


RECIPE_LIKE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512",
               "--swiglu", "--disable-bias-linear", "--num-experts", "8", "--moe-router-topk", "4",
               "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep",
               "--moe-router-num-groups", "4", "--moe-router-group-topk", "2", "--moe-router-dtype", "fp32",
               "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16",
               "--exp-avg-sq-dtype", "bf16", "--fp8-format", "hybrid", "--fp8-param-gather", "--grad-reduce-in-bf16",
               "--mtp-num-layers", "1"]


@pytest.mark.parametrize("argv", [RECIPE_LIKE, GPT_OSS_LIKE])
def test_the_hook_and_the_cli_read_the_same_model(megatron_parser, monkeypatch, argv):
    """The in-job plan and `pipette estimate` price the same model from the same Megatron flags: the
    hook reads every Workload field the CLI takes (here with Transformer Engine installed)."""
    from megatron_pipette.cli.args import DEFAULT_MODEL
    from megatron_pipette.cli.args import workload_from_args as cli_workload
    from megatron_pipette.cli.main import build_parser
    from megatron_pipette.integration import megatron_args

    monkeypatch.setattr(megatron_args, "transformer_engine_in_use", lambda args: True)
    argv = [*argv, "--vocab-size", "1000", "--global-batch-size", "8", "--bf16"]
    hook = megatron_args.workload_from_args(megatron_parser.parse_args(argv))
    cli = cli_workload(build_parser().parse_known_args(["estimate", *argv])[0], DEFAULT_MODEL)

    def fields(w):   # a list pattern's text is Megatron's list printed again: compare the layers it names
        return {**dataclasses.asdict(w), "name": None, "moe_layer_freq": w.moe_layer_pattern(),
                "window_attn_skip_freq": w.window_layer_pattern()}

    assert fields(hook) == fields(cli)


@pytest.mark.parametrize("argv", [
    ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512",
     "--ffn-hidden-size", "1024"],
    ["--num-layers", "6", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "1024",
     "--swiglu", "--group-query-attention", "--num-query-groups", "2", "--num-experts", "16",
     "--moe-router-topk", "4", "--moe-ffn-hidden-size", "128", "--moe-shared-expert-intermediate-size", "256",
     "--moe-layer-freq", "([0]+[1]*5)", "--disable-bias-linear"],
    ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512",
     "--multi-latent-attention", "--q-lora-rank", "96", "--kv-lora-rank", "64", "--qk-head-dim", "32",
     "--qk-pos-emb-head-dim", "16", "--v-head-dim", "24", "--qk-layernorm", "--swiglu", "--num-experts", "8",
     "--moe-layer-freq", "([0]+[1]*3)", "--disable-bias-linear", "--position-embedding-type", "rope",
     "--mtp-num-layers", "1"],
    ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512",
     "--multi-latent-attention", "--kv-lora-rank", "64", "--qk-head-dim", "32", "--v-head-dim", "32"],
    GPT_OSS_LIKE,
    ["--num-layers", "3", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512",
     "--mtp-num-layers", "2"],
])
def test_model_flops_match_megatrons_count(megatron_parser, argv):
    """Our TFLOP/s use Megatron's convention: its own num_floating_point_operations, on its parsed
    arguments (with the sizes validate_args derives filled in), gives the same FLOPs."""
    from megatron.training.training import num_floating_point_operations

    from megatron_pipette.integration.megatron_args import workload_from_args

    args = megatron_parser.parse_args([*argv, "--vocab-size", "1000", "--global-batch-size", "8",
                                       "--max-position-embeddings", "1024", "--bf16"])
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.kv_channels = args.hidden_size // args.num_attention_heads
    args.num_query_groups = args.num_query_groups or args.num_attention_heads
    args.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
    if isinstance(args.moe_layer_freq, str):
        args.moe_layer_freq = eval(args.moe_layer_freq)  # noqa: S307 - what Megatron's parser does
    workload = workload_from_args(args)
    args.padded_vocab_size = workload.padded_vocab_size(1)
    assert workload.model_flops_per_iteration() == pytest.approx(num_floating_point_operations(args, 8), rel=1e-12)


def test_moe_enable_deepep_is_the_flex_dispatchers_deepep_backend(megatron_parser):
    """TransformerConfig sets moe_flex_dispatcher_backend = "deepep" from the deprecated
    --moe-enable-deepep, and raises without the flex dispatcher or beside another backend."""
    from megatron_pipette.integration.megatron_args import workload_from_args

    base = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512",
            "--num-experts", "8", "--disable-bias-linear", "--vocab-size", "1000", "--global-batch-size", "8",
            "--bf16", "--moe-enable-deepep"]
    args = megatron_parser.parse_args([*base, "--moe-token-dispatcher-type", "flex"])
    assert refusals(vars(args)) == []
    assert workload_from_args(args).moe_flex_dispatcher_backend == "deepep"
    for wrong in (["--moe-token-dispatcher-type", "alltoall"],
                  ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"]):
        with pytest.raises(PipetteError, match="--moe-enable-deepep needs --moe-token-dispatcher-type flex"):
            workload_from_args(megatron_parser.parse_args([*base, *wrong]))
