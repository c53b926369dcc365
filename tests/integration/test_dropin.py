"""What the hook supplies to a launch written for GPUs: CPU rehearsal settings against Megatron's own
parsed defaults, the prebuilt dataset helpers, and the self-check's flags."""

import argparse
import os

import pytest

from megatron_pipette.integration import dropin
from megatron_pipette.integration.options import add_auto_parallel_args

pytestmark = pytest.mark.megatron

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


def megatron_args(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed by Megatron's own parser (its defaults are what a new user's launch gets)."""
    from megatron.training import arguments

    add = getattr(arguments.add_megatron_arguments, "__wrapped__", arguments.add_megatron_arguments)
    return add(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)


@pytest.fixture
def bare_cpu(monkeypatch):
    """Neither Transformer Engine nor Apex, and CUDA_DEVICE_MAX_CONNECTIONS unset."""
    monkeypatch.setattr(dropin, "_installed", lambda module: False)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)


def test_a_gpu_launch_line_gets_what_a_cpu_rehearsal_needs(bare_cpu) -> None:
    args = megatron_args(MODEL)
    changed = dropin.cpu_rehearsal_settings(args, MODEL)
    assert changed == ["--distributed-backend gloo (not nccl: NCCL needs GPUs)",
                       "--transformer-impl local (Transformer Engine is not installed)",
                       "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "CUDA_DEVICE_MAX_CONNECTIONS=1"]
    assert (args.distributed_backend, args.transformer_impl) == ("gloo", "local")
    assert args.no_persist_layer_norm and not args.gradient_accumulation_fusion
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_what_the_line_already_says_is_kept(bare_cpu, monkeypatch) -> None:
    typed = [*MODEL, "--distributed-backend", "gloo", "--transformer-impl=transformer_engine",
             "--no-persist-layer-norm", "--no-gradient-accumulation-fusion"]
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = megatron_args(typed)
    assert dropin.cpu_rehearsal_settings(args, typed) == []
    assert args.transformer_impl == "transformer_engine"


def test_with_transformer_engine_its_spec_and_fusions_stay(monkeypatch) -> None:
    monkeypatch.setattr(dropin, "_installed", lambda module: module == "transformer_engine")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = megatron_args(MODEL)
    assert dropin.cpu_rehearsal_settings(args, MODEL) == ["--distributed-backend gloo (not nccl: NCCL needs GPUs)"]
    assert args.transformer_impl == "transformer_engine" and args.gradient_accumulation_fusion


def test_prebuilt_dataset_helpers_are_not_rebuilt(monkeypatch) -> None:
    """The wheel ships helpers_cpp without a Makefile: Megatron's `make` must not run."""
    from megatron.core.datasets import utils

    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)
    dropin.use_prebuilt_dataset_helpers()
    assert utils.compile_helpers is dropin._prebuilt


@pytest.mark.parametrize("argv, message", [
    (["--auto-parallel-check-iterations", "-1"], "argument --auto-parallel-check-iterations: must be a whole"),
    (["--auto-parallel-check-iterations", "2.5"], "argument --auto-parallel-check-iterations: must be a whole"),
    (["--auto-parallel-replan-if-slower", "-3"], "argument --auto-parallel-replan-if-slower: must be a percentage"),
    (["--auto-parallel-replan-if-slower", "nan"], "argument --auto-parallel-replan-if-slower: must be a percentage"),
])
def test_self_check_flags_refuse_bad_values_by_name(argv, message, capsys) -> None:
    parser = add_auto_parallel_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert message in capsys.readouterr().err


def test_self_check_flags_default_to_five_iterations_and_keeping_the_layout() -> None:
    args = add_auto_parallel_args(argparse.ArgumentParser()).parse_args([])
    assert (args.auto_parallel_check_iterations, args.auto_parallel_replan_if_slower) == (5, None)
    args = add_auto_parallel_args(argparse.ArgumentParser()).parse_args(
        ["--auto-parallel-check-iterations", "0", "--auto-parallel-replan-if-slower", "7.5"])
    assert (args.auto_parallel_check_iterations, args.auto_parallel_replan_if_slower) == (0, 7.5)
