"""`pipette profile`: flags, output file, user errors."""

import json

import pytest

from megatron_pipette.cli.main import build_parser, main
from megatron_pipette.cli.measuring import profile_workload
from megatron_pipette.spec.layer_profile import check_profile_matches, profile_from_json
from megatron_pipette.spec.workload import workload_from_preset


def test_cli_writes_a_profile_the_planner_accepts(tmp_path, capsys):
    out = tmp_path / "layer_profile.json"
    rc = main(["profile", "--model", "tiny-gpt", "--seq-length", "32", "--tp", "1", "2", "--mbs", "2",
               "--recompute", "none", "--device", "cpu", "--warmup", "0", "--iters", "1", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    check_profile_matches(profile_from_json(doc), workload_from_preset("tiny-gpt", seq_length=32))
    assert {(e["tensor_model_parallel_size"], e["sequence_parallel"]) for e in doc["layers"]} == {
        (1, False), (2, False), (2, True)}
    assert "3 layer entries on cpu" in capsys.readouterr().out


def test_megatron_flags_override_the_preset():
    ns = build_parser().parse_args(["profile", "--model", "llama2-7b", "--num-layers", "2", "--hidden-size", "256",
                                    "--num-attention-heads", "8", "--ffn-hidden-size", "512", "--fp32",
                                    "--group-query-attention", "--num-query-groups", "2"])
    w = profile_workload(ns)
    assert (w.hidden_size, w.num_attention_heads, w.query_groups, w.ffn, w.swiglu, w.precision) == (
        256, 8, 2, 512, True, "fp32")
    w = profile_workload(build_parser().parse_args(["profile", "--model", "gpt3-125m", "--disable-bias-linear"]))
    assert not w.add_bias_linear


@pytest.mark.parametrize("argv,message", [
    (["--hidden-size", "64"], "missing --num-layers, --num-attention-heads, --seq-length"),
    (["--model", "tiny-gpt", "--tp", "3"], "--tp 3: --num-attention-heads 4 is not divisible"),
    (["--model", "tiny-gpt", "--out", "/no/such/dir/p.json"], "--out /no/such/dir/p.json: directory"),
    (["--model", "tiny-gpt", "--normalization", "BatchNorm"], "--normalization must be one of"),
])
def test_user_errors_print_one_line_and_exit_2(argv, message, capsys):
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pipette profile: error: {message}") and err.count("\n") == 1
