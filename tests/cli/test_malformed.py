"""No traceback on any input: hundreds of malformed `pipette` invocations, each ending in one line on
stderr and exit 2 (a user error) or 3 (no layout Megatron accepts), within 10 s.

The table is generated: every numeric flag of every subcommand times the values no flag of its kind
takes (negative, zero where it is invalid, above its bound, not a number, infinite, empty), every
enumerated flag times values outside its choices, every file a subcommand reads times the wrong
kinds of file (missing, a directory, a device, a FIFO, binary, empty, not JSON, nested past the
parser, JSON of the wrong shape, a cluster with impossible links), every file it writes times the
places it cannot write, and the cases reported from trying pipette by hand. They run in this process
(`main(argv)`); a few run the real entry point in a child interpreter to show it behaves the same.
Probing and profiling are made impossible while they run: a case that got past the checks into
torch fails instead of measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import megatron_pipette.probe
import megatron_pipette.profile
from megatron_pipette.cli.main import build_parser, main
from megatron_pipette.spec.cluster_file import cluster_to_json
from megatron_pipette.spec.hardware import preset_cluster

LIMIT_S = 10.0
HUGE = "1" + "0" * 30
MODEL = ["--model", "gpt3-1.3b", "--num-nodes", "1"]
CONTEXT = {
    "plan": MODEL,
    "estimate": MODEL,
    "profile": ["--model", "tiny-gpt", "--out", "{tmp}/profile.json"],
    "probe": ["--out", "{tmp}/cluster.json"],
    "probe-sim": ["--truth", "{tmp}/truth.json", "--world-size", "16", "--gpus-per-node", "8",
                  "--out", "{tmp}/probed.json"],
    "show": ["{tmp}/truth.json"],
    "compare": ["{tmp}/profile_in.json"],
}
"""What each subcommand needs besides the flag under test (valid, so the flag is what fails)."""
NEEDS = {
    "--num-query-groups": ["--group-query-attention"],
    **{flag: ["--num-experts", "4", "--swiglu", "--disable-bias-linear"]
       for flag in ("--moe-router-topk", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
                    "--moe-expert-capacity-factor", "--moe-layer-freq", "--moe-router-num-groups",
                    "--moe-router-group-topk")},
}
"""Flags that only count beside another one."""
INT_BAD = ["-1", "0", HUGE, "abc", "1.5", "1e20", "inf", "nan", ""]
FLOAT_BAD = ["-1", "0", "inf", "nan", "1e400", "abc", ""]
SIZE_BAD = ["infK", "nanM", "-4K", "0", "abc", "1e30G", "4.5", "", "2G"]
STR_BAD = ["bogus", ""]
VALID = {
    ("--decoder-first-pipeline-num-layers", "0"), ("--decoder-last-pipeline-num-layers", "0"),
    ("--warmup", "0"), ("--rank", "0"), ("--seed", "0"), ("--noise", "0"), ("--top", HUGE),
    ("--world-size", HUGE), ("--gpus-per-node", HUGE), ("--cpu-offloading-num-layers", "0"),
}
"""(flag, value) pairs that are not malformed: zero layers on a stage, zero warm-up iterations, rank
or seed 0, no layer offloaded (Megatron's default), exact timings; --top above the number of layouts
lists them all. (--world-size and --gpus-per-node of probe-sim must match the truth file: huge values
are tried there by file.)"""
FLOAT_VALID = {("--attention-dropout", "0"), ("--hidden-dropout", "0"), ("--memory-headroom", "0"),
               *((flag, value) for flag in ("--mscale", "--mscale-all-dim", "--moe-paged-stash-buffer-size-factor-cuda",
                                            "--moe-paged-stash-buffer-size-factor-cpu") for value in ("-1", "0"))}
"""Zero dropout; no memory headroom (the fastest layout that fits); YaRN's mscale values, which
Megatron takes of any sign (they weigh a logarithm); the paged stash's buffer factors, whose sign
chooses how the buffer is sized and whose 0 means no host buffer (alone, without --moe-paged-stash,
they act on nothing)."""
ENUMS = {"--position-embedding-type", "--normalization", "--attention-backend", "--fp8-format", "--fp8-recipe",
         "--moe-token-dispatcher-type", "--recompute-granularity", "--recompute-method", "--cp-comm-type",
         "--recompute-modules", "--precision", "--gpu", "--cluster"}
"""Flags of text that take one of a few values (the others, files and expressions, are cases below)."""


def _actions(command: str) -> list[argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions if a.option_strings and a.nargs != 0 and a.dest != "help"]


def bad_values(action: argparse.Action) -> list[str]:
    flag, kind = action.option_strings[0], getattr(action.type, "__name__", None)
    if action.choices is not None or flag in ENUMS:
        return STR_BAD
    if kind == "float":
        return FLOAT_BAD + (["1", "1.5"] if "dropout" in flag else [])
    return {"int": INT_BAD, "parse_size": SIZE_BAD}.get(kind, [])


def generated() -> list[tuple[str, list[str]]]:
    """Every flag that takes a value, of every subcommand, times the values no such flag takes."""
    cases = []
    for command in CONTEXT:
        for action in _actions(command):
            flag = action.option_strings[0]
            cases += [(f"{command} {flag} {value!r}", [command, *CONTEXT[command], *NEEDS.get(flag, []), flag, value])
                      for value in bad_values(action) if (flag, value) not in VALID | FLOAT_VALID]
    return cases


def files(tmp: str) -> dict[str, str]:
    """Paths of every wrong kind of file, made by the fixture below."""
    return {"missing": f"{tmp}/nope.json", "directory": tmp, "device": "/dev/null", "fifo": f"{tmp}/fifo",
            "binary": f"{tmp}/binary.bin", "empty": f"{tmp}/empty.json", "not json": f"{tmp}/text.json",
            "deep": f"{tmp}/deep.json", "list": f"{tmp}/list.json", "number": f"{tmp}/number.json",
            "huge int": f"{tmp}/hugeint.json", "latin-1": f"{tmp}/latin1.json"}


CLUSTER_MUTATIONS = {
    "zero bandwidth": lambda d: d["inter_node"]["bandwidth_Bps"][0].__setitem__(1, 0.0),
    "1e-300 bandwidth": lambda d: d["inter_node"]["bandwidth_Bps"][0].__setitem__(1, 1e-300),
    "NaN latency": lambda d: d["intra_node"][0]["latency_s"][0].__setitem__(1, float("nan")),
    "infinite memory": lambda d: d["devices"]["memory_bytes"].__setitem__(0, float("inf")),
    "1e-300 flops": lambda d: d["devices"]["gemm_flops"].__setitem__(0, 1e-300),
    "a billion nodes": lambda d: d.update(num_nodes=10 ** 9),
    "nodes not a list": lambda d: d.update(nodes=7),
    "devices a list": lambda d: d.update(devices=[1, 2]),
    "no schema": lambda d: d.pop("schema"),
    "version 99": lambda d: d.update(version=99),
    "encoded matrix of a wrong shape": lambda d: d["inter_node"].update(
        bandwidth_Bps={"float32_base64": "AAAAAA==", "shape": [10 ** 9, 10 ** 9]}),
    "cross-rail NaN": lambda d: d["inter_node"].update(cross_rail_latency_s=float("nan")),
}
"""JSON of the cluster schema with impossible contents (the truth file is two DGX H100 nodes)."""
PROFILE_DOCS = {
    "profile of no schema": {"layers": []},
    "profile of no layers": {"schema": "megatron-pipette/layer-profile", "version": 1, "layers": []},
    "profile of NaN times": {"schema": "megatron-pipette/layer-profile", "version": 1, "device": {},
                             "layers": [{"tensor_model_parallel_size": 1, "micro_batch_size": 1, "forward_s": "nan",
                                         "backward_s": 1.0, "activation_bytes": 1}]},
    "profile of infinite bytes": {"schema": "megatron-pipette/layer-profile", "version": 1, "device": {},
                                  "layers": [{"tensor_model_parallel_size": 1, "micro_batch_size": 1,
                                              "forward_s": 1.0, "backward_s": 1.0, "activation_bytes": 1e400}]},
    "profile of a device list": {"schema": "megatron-pipette/layer-profile", "version": 1, "device": [1],
                                 "layers": [{"tensor_model_parallel_size": 1, "micro_batch_size": 1,
                                             "forward_s": 1.0, "backward_s": 1.0, "activation_bytes": 1}]},
    "profile of a text rank": {"schema": "megatron-pipette/layer-profile", "version": 1,
                               "device": {"rank": "zero"},
                               "layers": [{"tensor_model_parallel_size": 1, "micro_batch_size": 1,
                                           "forward_s": 1.0, "backward_s": 1.0, "activation_bytes": 1}]},
}
PLAN_DOCS = {
    "plan of no schema": {"candidates": []},
    "plan of no candidate": {"schema": "megatron-pipette/plan", "version": 1, "candidates": []},
    "plan of a text node size": {"schema": "megatron-pipette/plan", "version": 1, "model": {},
                                 "candidates": [{"layout": {}, "placement": {"node_order": [0],
                                                                             "gpus_per_node": "eight"}}]},
    "plan of a bad node order": {"schema": "megatron-pipette/plan", "version": 1,
                                 "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                           "seq_length": 64, "global_batch_size": 8},
                                 "candidates": [{"layout": {"data_parallel_size": 8},
                                                 "placement": {"node_order": [5], "gpus_per_node": 8}}]},
    "plan of a huge model": {"schema": "megatron-pipette/plan", "version": 1,
                             "model": {"num_layers": 10 ** 9, "hidden_size": 64, "num_attention_heads": 4,
                                       "seq_length": 64, "global_batch_size": 8},
                             "candidates": [{"layout": {"data_parallel_size": 8},
                                             "placement": {"node_order": [0], "gpus_per_node": 8}}]},
    "plan of a node order of mixed kinds": {"schema": "megatron-pipette/plan", "version": 1, "model": {},
                                            "candidates": [{"layout": {}, "placement": {"node_order": ["a", 1],
                                                                                        "gpus_per_node": 8}}]},
    "plan of a layout of strings": {"schema": "megatron-pipette/plan", "version": 1,
                                    "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                              "seq_length": 64, "global_batch_size": 8},
                                    "candidates": [{"layout": {"tensor_model_parallel_size": "8"},
                                                    "placement": {"node_order": [0], "gpus_per_node": 8}}]},
}


def written(what: str) -> str:
    """The file the fixture writes for one of the documents above."""
    return f"{{tmp}}/{what.replace(' ', '_')}.json"


def file_cases() -> list[tuple[str, list[str]]]:
    """Every file a subcommand reads, times every wrong kind of file; every file it writes, times
    the places it cannot write. (Never a device outside the test's folder as a place to write: code
    that wrote atomically over /dev/null as root would replace it with a regular file.)"""
    readers = {
        "plan --cluster": lambda f: ["plan", "--model", "gpt3-1.3b", "--cluster", f],
        "plan --layer-profile": lambda f: ["plan", *MODEL, "--layer-profile", f],
        "estimate --plan": lambda f: ["estimate", "--plan", f, "--cluster", "dgx-h100", "--num-nodes", "1"],
        "show": lambda f: ["show", f],
        "compare": lambda f: ["compare", f],
        "probe-sim --truth": lambda f: ["probe-sim", "--truth", f, "--world-size", "16", "--gpus-per-node", "8",
                                        "--out", "{tmp}/probed.json"],
    }
    cases = [(f"{reader} <{kind}>", build(path)) for reader, build in readers.items()
             for kind, path in files("{tmp}").items()]
    cases += [(f"{reader} <{what}>", readers[reader](written(what)))
              for reader in ("plan --cluster", "show", "probe-sim --truth") for what in CLUSTER_MUTATIONS]
    cases += [(f"plan --layer-profile <{what}>", readers["plan --layer-profile"](written(what)))
              for what in PROFILE_DOCS]
    cases += [(f"estimate --plan <{what}>", readers["estimate --plan"](written(what))) for what in PLAN_DOCS]
    writers = {
        "profile --out": lambda f: ["profile", "--model", "tiny-gpt", "--out", f],
        "probe --out": lambda f: ["probe", "--out", f],
        "probe-sim --out": lambda f: ["probe-sim", "--truth", "{tmp}/truth.json", "--world-size", "8",
                                      "--gpus-per-node", "8", "--out", f],
        "show --heatmap": lambda f: ["show", "{tmp}/truth.json", "--heatmap", f],
    }
    unwritable = {"a directory": "{tmp}", "no such directory": "{tmp}/nope/out.json", "a FIFO": "{tmp}/fifo",
                  **({} if os.geteuid() == 0 else {"a read-only directory": "{tmp}/readonly/out.json"})}
    cases += [(f"{writer} <{kind}>", build(path)) for writer, build in writers.items()
              for kind, path in unwritable.items()]
    return cases


REPORTED_CASES = [
    ("reported: --num-nodes 1000000000", ["plan", "--num-nodes", "1000000000"]),
    ("reported: --hidden-size 1000000000", ["plan", "--model", "gpt3-1.3b", "--hidden-size", "1000000000"]),
    ("reported: --num-layers 1e20", ["plan", "--num-layers", "1e20"]),
    ("reported: --num-layers 100000000 on a preset", ["plan", "--model", "gpt3-1.3b", "--num-layers", "100000000"]),
    ("reported: --global-batch-size 1000000000", ["plan", *MODEL, "--global-batch-size", "1000000000"]),
    ("reported: --gpus-per-node 1000000000", ["plan", "--gpus-per-node", "1000000000"]),
    ("reported: --tensor-model-parallel-size 3", ["plan", "--tensor-model-parallel-size", "3"]),
    ("reported: --context-parallel-size 3", ["plan", *MODEL, "--context-parallel-size", "3"]),
    ("reported: --pipeline-model-parallel-size 5", ["plan", *MODEL, "--pipeline-model-parallel-size", "5"]),
    ("reported: --micro-batch-size above the batch", ["plan", *MODEL, "--micro-batch-size", "1024"]),
    ("reported: --max-position-embeddings below --seq-length",
     ["plan", *MODEL, "--max-position-embeddings", "1024"]),
    ("reported: --small-bytes infK", ["probe", "--out", "{tmp}/c.json", "--small-bytes", "infK"]),
    ("reported: --moe-layer-freq [1]*9**9**9",
     ["plan", *MODEL, *NEEDS["--moe-layer-freq"], "--moe-layer-freq", "[1]*9**9**9"]),
    ("reported: --moe-layer-freq [][0]", ["plan", *MODEL, *NEEDS["--moe-layer-freq"], "--moe-layer-freq", "[][0]"]),
    ("reported: --moe-layer-freq [1]*10**20",
     ["plan", *MODEL, *NEEDS["--moe-layer-freq"], "--moe-layer-freq", "[1]*10**20"]),
    ("--moe-layer-freq without experts", ["plan", *MODEL, "--moe-layer-freq", "[1]*9**9**9"]),
    ("--moe-layer-freq of the wrong length", ["plan", *MODEL, *NEEDS["--moe-layer-freq"], "--moe-layer-freq", "[1]*3"]),
    ("--pipeline-model-parallel-layout t*99999999999",
     ["plan", *MODEL, "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*99999999999|L"]),
    ("--pipeline-model-parallel-layout of an unknown letter",
     ["plan", *MODEL, "--pipeline-model-parallel-layout", "Ex|tL"]),
    ("--pipeline-model-parallel-layout of too few layers",
     ["plan", *MODEL, "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tL"]),
    ("--pipeline-model-parallel-layout empty", ["plan", *MODEL, "--pipeline-model-parallel-layout", ""]),
    ("--fp8-recipe without --fp8-format", ["plan", *MODEL, "--fp8-recipe", "bogus"]),
    ("--moe-token-dispatcher-type without experts", ["plan", *MODEL, "--moe-token-dispatcher-type", "bogus"]),
    ("--moe-router-topk above the experts", ["plan", *MODEL, *NEEDS["--moe-router-topk"], "--moe-router-topk", "5"]),
    ("reported: --num-experts 4 --moe-router-topk 2 without --swiglu --disable-bias-linear",
     ["plan", *MODEL, "--num-experts", "4", "--moe-router-topk", "2"]),
    ("--num-experts --swiglu with biases", ["plan", *MODEL, "--num-experts", "4", "--swiglu"]),
    ("a refused Megatron flag", ["plan", *MODEL, "--moe-shared-expert-gate"]),
    ("a refused Megatron value", ["plan", *MODEL, "--optimizer", "sgd"]),
    ("a Megatron flag the planner models but pipette does not take", ["plan", *MODEL, "--padded-vocab-size", "5"]),
    ("neither a pipette nor a Megatron flag", ["plan", *MODEL, "--not-a-flag", "3"]),
    ("an abbreviated flag", ["plan", "--model", "gpt3-1.3b", "--num-nod", "1"]),
    ("a stray word", ["plan", *MODEL, "stray"]),
    ("a flag with a newline in its value", ["plan", "--model", "gpt3-1.3b", "--cluster", "a\nb"]),
    ("no subcommand", []),
    ("an unknown subcommand", ["replan"]),
    ("probe without --out", ["probe"]),
    ("probe-sim without --truth", ["probe-sim", "--world-size", "16", "--gpus-per-node", "8", "--out", "x.json"]),
    ("probe --large-bytes below --small-bytes", ["probe", "--out", "{tmp}/c.json", "--large-bytes", "1K"]),
    ("probe-sim of the wrong world size", ["probe-sim", "--truth", "{tmp}/truth.json", "--world-size", HUGE,
                                           "--gpus-per-node", "8", "--out", "{tmp}/probed.json"]),
    ("estimate --plan with model flags", ["estimate", "--plan", "{tmp}/plan.json", "--num-layers", "4"]),
    ("estimate of a layout that does not divide", ["estimate", *MODEL, "--tensor-model-parallel-size", "3"]),
    ("estimate --cluster file with --num-nodes", ["estimate", "--model", "gpt3-1.3b", "--cluster",
                                                  "{tmp}/truth.json", "--num-nodes", "2"]),
    ("profile without a model", ["profile", "--out", "{tmp}/p.json"]),
    ("profile --tp that does not divide the heads", ["profile", *CONTEXT["profile"], "--tp", "3"]),
    ("profile --cp that does not divide the sequence", ["profile", *CONTEXT["profile"], "--cp", "3"]),
    ("plan --layer-profile of another model", ["plan", "--model", "gpt3-125m", "--num-nodes", "1",
                                               "--layer-profile", "{tmp}/profile_in.json"]),
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    """A folder holding every file the cases name."""
    root = tmp_path_factory.mktemp("malformed")
    os.mkfifo(root / "fifo")
    (root / "binary.bin").write_bytes(bytes(range(256)) * 64)
    (root / "empty.json").write_text("")
    (root / "text.json").write_text("{not json")
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "list.json").write_text("[1, 2, 3]")
    (root / "number.json").write_text("3")
    (root / "hugeint.json").write_text('{"schema": ' + "9" * 5000 + "}")
    (root / "latin1.json").write_bytes('{"name": "café"}'.encode("latin-1"))
    (root / "readonly").mkdir(mode=0o555)
    truth = cluster_to_json(preset_cluster("dgx-h100", num_nodes=2))
    (root / "truth.json").write_text(json.dumps(truth))
    for what, mutate in CLUSTER_MUTATIONS.items():
        doc = json.loads(json.dumps(truth))
        mutate(doc)
        Path(written(what).replace("{tmp}", str(root))).write_text(json.dumps(doc))
    for what, doc in {**PROFILE_DOCS, **PLAN_DOCS}.items():
        Path(written(what).replace("{tmp}", str(root))).write_text(json.dumps(doc))
    profile = {"schema": "megatron-pipette/layer-profile", "version": 1, "device": {"device_name": "cpu"},
               "model": {"hidden_size": 1}, "layers": [{"tensor_model_parallel_size": 1, "micro_batch_size": 1,
                                                        "forward_s": 1.0, "backward_s": 1.0, "activation_bytes": 1}]}
    (root / "profile_in.json").write_text(json.dumps(profile))
    plan = {"schema": "megatron-pipette/plan", "version": 1, "candidates": []}
    (root / "plan.json").write_text(json.dumps(plan))
    yield str(root)
    (root / "readonly").chmod(0o755)


CASES = generated() + file_cases() + REPORTED_CASES


def test_the_table_is_large_and_its_cases_distinct():
    assert len(CASES) >= 200
    names = [name for name, _ in CASES]
    assert len(names) == len(set(names))


class _TooSlow(Exception):
    pass


@pytest.fixture
def no_measurement(monkeypatch):
    """Probing and profiling cannot start: a case that passed every check would fail importing them,
    not measure this machine (nor hold a port) for minutes."""
    for module, name in ((megatron_pipette.probe, "runner"), (megatron_pipette.profile, "profiler"),
                         (megatron_pipette.profile, "profile_layers")):
        if name in vars(module):         # (hasattr would import them: the packages load them lazily)
            monkeypatch.delattr(module, name)
    for name in ("torch", "megatron", "megatron_pipette.probe.runner", "megatron_pipette.profile.profiler"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delenv("RANK", raising=False)


def run_in_process(argv: list[str], capsys) -> tuple[int, str, str, float]:
    def too_slow(signum, frame):
        raise _TooSlow(f"still running after {LIMIT_S:g} s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
    started = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - started
    out, err = capsys.readouterr()
    return code, out, err, elapsed


@pytest.mark.parametrize("name, argv", CASES, ids=[name for name, _ in CASES])
def test_a_malformed_invocation_ends_in_one_line(name, argv, tmp, capsys, no_measurement):
    argv = [word.replace("{tmp}", tmp) for word in argv]
    code, out, err, elapsed = run_in_process(argv, capsys)
    assert code in (2, 3), (code, out[-500:], err[-2000:])
    assert err.endswith("\n") and err.count("\n") == 1, err[-2000:]
    assert "Traceback" not in err and out == "", (out[-500:], err)
    assert elapsed < LIMIT_S


SUBPROCESS_CASES = ["reported: --num-layers 1e20", "reported: --small-bytes infK",
                    "reported: --moe-layer-freq [1]*9**9**9", "reported: --tensor-model-parallel-size 3",
                    "show <binary>", "plan --cluster <directory>", "plan --cluster <1e-300 bandwidth>",
                    "profile --mbs '0'"]


@pytest.mark.torchrun
@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_the_real_entry_point_behaves_the_same(name, tmp):
    """`python -m megatron_pipette`, a fresh interpreter: the same code, one line, no traceback."""
    argv = [word.replace("{tmp}", tmp) for word in dict(CASES)[name]]
    started = time.perf_counter()
    child = subprocess.run([sys.executable, "-m", "megatron_pipette", *argv], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    elapsed = time.perf_counter() - started
    assert child.returncode in (2, 3), child.stderr
    assert child.stderr.count("\n") == 1 and "Traceback" not in child.stderr, child.stderr
    assert child.stdout == "" and elapsed < LIMIT_S + 5      # the interpreter's start on a loaded machine
