import json
import re
from importlib.metadata import entry_points

import pytest

from megatron_pipette.cli.main import main
from megatron_pipette.spec.cluster_file import cluster_to_json
from megatron_pipette.spec.hardware import preset_cluster

SMALL = ["--model", "gpt3-1.3b", "--global-batch-size", "64", "--num-nodes", "1"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_default_prints_table_flags_and_breakdown(capsys):
    code, out, _ = run(capsys, "plan", "--top", "3")
    assert code == 0
    assert "Planned gpt3-13b in bf16 on dgx-a100x4 (32 GPUs)" in out
    assert "--tensor-model-parallel-size" in out and "where the time goes" in out and "capacity" in out


def test_plan_json_lists_candidates_best_first(capsys):
    code, out, _ = run(capsys, "plan", *SMALL, "--json", "--top", "4")
    doc = json.loads(out)
    times = [c["iteration_time_s"] for c in doc["candidates"]]
    assert code == 0 and times == sorted(times) and len(times) == 4
    c = doc["candidates"][0]
    assert c["tflops_per_gpu"] > 0 and c["memory"]["fits"] is True
    assert c["memory"]["capacity_bytes"] == preset_cluster("dgx-a100").memory_bytes
    assert all(s["peak_bytes"] <= c["memory"]["capacity_bytes"] for s in c["memory"]["stages"])


def test_estimate_accepts_tensor_parallel_across_nodes(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "gpt3-6.7b", "--num-nodes", "2",
                       "--tensor-model-parallel-size", "16", "--sequence-parallel", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["layout"]["tensor_model_parallel_size"] == 16
    assert doc["layout"]["data_parallel_size"] == 1
    assert doc["breakdown_s"]["tp_comm_s"] > 0 and len(doc["memory"]["stages"]) == 1


@pytest.mark.parametrize("impl", [["--transformer-impl", "local"],
                                  ["--transformer-impl=local", "--attention-backend", "flash"]])
def test_estimate_local_layers_price_the_unfused_attention(capsys, impl):
    """Megatron's local layer spec builds DotProductAttention, which keeps the s x s scores whatever
    --attention-backend says: the estimate prices what the in-job plan prices (measured on an H200:
    docs/validation.md, "The planner's prices on one GPU")."""
    def estimate(*extra):
        code, out, _ = run(capsys, "estimate", *SMALL, "--json", *extra)
        assert code == 0
        return json.loads(out)["memory"]["stages"][0]["activation_bytes"]
    fused = estimate("--transformer-impl", "transformer_engine")
    assert estimate(*impl) == estimate("--attention-backend", "local") > 2 * fused


def test_estimate_text_reports_stages(capsys):
    code, out, _ = run(capsys, "estimate", *SMALL, "--tensor-model-parallel-size", "2",
                       "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "6")
    assert code == 0 and "s/iteration" in out and out.count("yes") == 2


@pytest.mark.parametrize("argv, message", [
    (["estimate", *SMALL, "--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3"),
    (["estimate", "--model", "gpt3-1.3b", "--num-attention-heads", "15"], "--num-attention-heads 15"),
    (["plan", "--num-layers", "24", "--hidden-size", "1024"], "missing --num-attention-heads"),
    (["plan", "--model", "gpt3-1.3b", "--num-layers", "-2"], "--num-layers must be a positive integer"),
    (["plan", "--gpu", "R100"], "--gpu 'R100'"),
    (["plan", "--cluster", "/nonexistent.json"], "--cluster '/nonexistent.json'"),
    (["plan", "--micro-batch-size", "0"], "--micro-batch-size must be a positive integer"),
    (["plan", "--top", "0"], "--top must be a positive integer"),
    (["estimate", *SMALL, "--pipeline-model-parallel-size", "5"], "does not divide the 8 GPUs"),
    (["estimate", "--model", "gpt3-1.3b", "--num-nodes", "5", "--gpus-per-node", "1",
      "--pipeline-model-parallel-size", "5"], "--num-layers 24"),
])
def test_bad_input_is_one_clear_message(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, message", [
    (["plan", "--moe-shared-expert-gate"], "--moe-shared-expert-gate: this mixture-of-experts option is not modelled"),
    (["plan", "--fp8-format=hybrid", "--first-last-layers-bf16"], "--first-last-layers-bf16: FP8 options other than"),
    (["plan", "--model", "llama3-8b", "--fp8-format", "hybrid"], "--fp8-format: A100-80GB has no FP8 tensor cores"),
    (["estimate", *SMALL, "--hybrid-context-parallel"], "--hybrid-context-parallel: hierarchical or hybrid"),
    (["plan", "--tp-comm-overlap-rs-dgrad"], "--tp-comm-overlap-rs-dgrad: the model prices --tp-comm-overlap with"),
    (["plan", "--no-overlap-p2p-communication"], "--no-overlap-p2p-communication: the model prices Megatron's"),
    (["plan", "--cp-comm-type", "a2a", "p2p"], "--cp-comm-type a2a p2p: a type per layer is not modelled"),
    (["plan", "--num-experts", "8", "--moe-shared-expert-intermediate-size", "64"],
     "--moe-shared-expert-intermediate-size needs --disable-bias-linear"),
    (["plan", "--optimizer", "sgd"], "--optimizer sgd: only adam is modelled"),
    (["plan", "--num-experts", "4", "--moe-router-topk", "2"],
     "--num-experts 4 with GELU experts and biases: megatron-core fuses a routed expert's bias and activation for "
     "SwiGLU and quick-GeGLU only (its first forward raises \"Only support fusion of swiglu and quick_gelu\"); add "
     "--swiglu --disable-bias-linear"),
    (["plan", "--num-experts", "4", "--swiglu", "--no-bias-gelu-fusion"], "--num-experts 4 --swiglu with biases"),
    (["plan", "--position-embedding-type", "mrope"], "--position-embedding-type must be one of"),
    (["plan", "--padded-vocab-size", "50304"], "--padded-vocab-size: not a pipette flag"),
    (["plan", "--model", "mixtral-8x7b", "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend",
      "hybridep", "--moe-paged-stash"], "--moe-paged-stash needs --moe-expert-rank-capacity-factor"),
])
def test_megatron_flags_the_planner_cannot_price_are_one_line_errors(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and err.startswith(f"pipette {argv[0]}: error: {message}") and out == ""
    assert err.count("\n") == 1, err


def test_a_pasted_launch_line_plans_as_its_model_flags(capsys):
    launch = ["--context-parallel-size", "1", "--moe-router-topk", "2", "--lr", "1e-4", "--adam-eps", "-1e-8",
              "--save=/ckpt", "--transformer-impl", "transformer_engine", "--no-masked-softmax-fusion",
              "--optimizer", "adam"]   # --transformer-impl local is not neutral (the local attention)
    code, out, err = run(capsys, "estimate", *SMALL, "--tensor-model-parallel-size", "2", *launch)
    assert code == 0 and err == ""
    assert (code, out) == run(capsys, "estimate", *SMALL, "--tensor-model-parallel-size", "2")[:2]


LAUNCH_LINE = " ".join([
    "--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024",
    "--micro-batch-size 4 --global-batch-size 32 --lr 0.00015 --train-iters 500000 --lr-decay-iters 320000",
    "--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0",
    "--data-path /data/my-gpt2_text_document --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt",
    "--split 949,50,1 --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10",
    "--save /ckpt --load /ckpt --tensorboard-dir /tb --use-mcore-models --transformer-impl transformer_engine",
    "--no-bias-dropout-fusion --distributed-backend nccl"]).split()
"""Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh's kind of launch line, shrunk, without
--bf16 or --fp16: Megatron trains it in fp32."""


def test_a_pasted_megatron_launch_line_plans_in_megatrons_precision(capsys):
    """`pipette plan` once planned such a line in bf16 (a different job, which then did not fit where
    Megatron's fp32 job would not either, or the reverse). It reads the line with Megatron's defaults,
    ignores the flags that change no cost (learning rate, data, logging), and says the precision."""
    code, out, err = run(capsys, "plan", *LAUNCH_LINE, "--num-nodes", "1", "--json")
    assert code == 0 and err == "", err
    doc = json.loads(out)
    assert doc["model"]["precision"] == "fp32" and doc["candidates"][0]["layout"]["micro_batch_size"] == 4
    code, out, _ = run(capsys, "plan", *LAUNCH_LINE, "--num-nodes", "1", "--top", "1")
    assert code == 0 and out.startswith("Planned custom in fp32 (Megatron's default: neither --bf16 nor --fp16 "
                                        "given) on dgx-a100x1 (8 GPUs)")
    code, out, _ = run(capsys, "plan", *LAUNCH_LINE, "--bf16", "--num-nodes", "1", "--top", "1")
    assert code == 0 and out.startswith("Planned custom in bf16 on dgx-a100x1")
    code, out, _ = run(capsys, "estimate", *LAUNCH_LINE, "--num-nodes", "1")
    assert code == 0 and out.startswith("tp1 pp1 dp8 mbs4 in fp32 (Megatron's default: neither")


def test_a_preset_keeps_its_precision_and_flags_override_it(capsys):
    code, out, _ = run(capsys, "plan", *SMALL, "--top", "1")
    assert code == 0 and out.startswith("Planned gpt3-1.3b in bf16 on dgx-a100x1")
    code, out, _ = run(capsys, "plan", *SMALL, "--fp16", "--top", "1")
    assert code == 0 and out.startswith("Planned gpt3-1.3b in fp16 on dgx-a100x1")


def test_every_neutral_megatron_flag_is_accepted_and_changes_nothing(capsys):
    """Every option of every argument the flag table classes neutral, at once, each with a word after
    it (a switch's is a stray word Megatron would refuse, pipette ignores it with the flag; the few
    modelled for some values only get one of those): the same estimate as without them."""
    from megatron_pipette.spec.megatron_flags import ALLOWED_VALUES, flag_table

    table = flag_table()
    neutral = [(option, ALLOWED_VALUES.get(name, ("7",))[0]) for name in sorted(table.neutral)
               for option in table.options[name]]
    assert len(neutral) > 100
    pasted = [word for option_value in neutral for word in option_value]
    code, out, err = run(capsys, "estimate", *SMALL, *pasted)
    assert (code, err) == (0, "")
    assert out == run(capsys, "estimate", *SMALL)[1]


@pytest.mark.parametrize("argv", [["plan", "--not-a-flag", "3"], ["plan", "--num-experts=8", "stray"],
                                  ["show", "c.json", "--lr", "1e-4"]])
def test_flags_neither_pipette_nor_megatron_get_argparses_error(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "unrecognized arguments: " in capsys.readouterr().err


def test_every_modelled_megatron_flag_is_a_pipette_flag_or_refused_by_it():
    from megatron_pipette.cli.main import build_parser
    from megatron_pipette.spec.megatron_flags import flag_table

    table = flag_table()
    for command in ("plan", "estimate"):
        parser = build_parser()._subparsers._group_actions[0].choices[command]
        options = {o for action in parser._actions for o in action.option_strings}
        megatron = {name for name, names in table.options.items() if options & set(names)}
        assert megatron <= table.modelled and table.modelled - megatron == {"padded_vocab_size"}


def test_bad_cluster_file(capsys, tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    code, _, err = run(capsys, "plan", "--cluster", str(bad))
    assert code == 2 and "not valid JSON" in err


def test_nothing_fits_exits_nonzero_with_advice(capsys):
    code, _, err = run(capsys, "plan", "--model", "gpt3-175b", "--num-nodes", "1")
    assert code == 3
    assert "nothing fits" in err and "more GPUs" in err


def test_plan_and_show_read_a_cluster_file(capsys, tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster_to_json(preset_cluster("dgx-h100", num_nodes=2))))
    code, out, _ = run(capsys, "plan", "--model", "gpt3-1.3b", "--global-batch-size", "64", "--cluster",
                       str(path), "--top", "2")
    assert code == 0 and "(16 GPUs)" in out
    png = tmp_path / "links.png"
    code, out, _ = run(capsys, "show", str(path), "--heatmap", str(png))
    assert code == 0 and png.stat().st_size > 1000


def test_plan_and_show_draw_the_best_layouts_timeline(capsys, tmp_path):
    """`plan --timeline` draws the best candidate (the JSON stays clean on stdout); `show --plan` draws
    the same picture from the plan document, on the cluster file it shows."""
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(cluster_to_json(preset_cluster("dgx-a100", num_nodes=1))))
    planned, shown = tmp_path / "plan.png", tmp_path / "show.png"
    code, out, err = run(capsys, "plan", *SMALL, "--pipeline-model-parallel-size", "2", "--top", "2", "--json",
                         "--timeline", str(planned))
    assert code == 0 and err == f"timeline written to {planned}\n"
    doc = json.loads(out)
    (tmp_path / "plan.json").write_text(out)
    code, out, _ = run(capsys, "show", str(cluster), "--plan", str(tmp_path / "plan.json"), "--timeline", str(shown))
    assert code == 0 and out.startswith("Cluster ") and f"timeline written to {shown}" in out
    assert f"{doc['candidates'][0]['iteration_time_s']:.3f} s/iteration" in out
    assert planned.read_bytes().startswith(b"\x89PNG") and planned.read_bytes() == shown.read_bytes()


@pytest.mark.parametrize("argv, message", [
    (["plan", "--timeline", "/nonexistent/t.png"], "--timeline /nonexistent/t.png: directory /nonexistent does not"),
    (["show", "--timeline", "t.png"], "--timeline t.png draws a plan: give --plan PLAN_JSON"),
    (["show", "--heatmap", "h.png", "--plan", "p.json"], "--heatmap h.png draws a cluster file's links"),
    (["show"], "give a cluster file to summarise, or --plan PLAN_JSON"),
    (["show", "c.json", "--num-nodes", "2"], "--num-nodes price a plan: give --plan PLAN_JSON"),
    (["show", "--plan", "/nonexistent.json"], "--plan /nonexistent.json: no such file"),
])
def test_pictures_refuse_what_they_cannot_draw_in_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1 and not out


@pytest.mark.torchrun
def test_plan_without_a_picture_does_not_load_matplotlib():
    """A child interpreter: this one has loaded matplotlib for the other tests."""
    import subprocess
    import sys

    code = ("import sys; from megatron_pipette.cli.main import main; "
            f"main({['plan', *SMALL, '--top', '1']!r}); print(sorted(m for m in sys.modules if 'matplotlib' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.splitlines()[-1] == "[]"


def test_console_script_help(capsys):
    """The installed `pipette` script's entry point, run in this process."""
    (script,) = entry_points(group="console_scripts", name="pipette")
    with pytest.raises(SystemExit) as stop:
        script.load()(["plan", "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0
    assert "--tensor-model-parallel-size" in out and "--num-query-groups" in out and "--cluster" in out


def test_layer_profile_must_come_from_the_clusters_device(capsys, tmp_path):
    from megatron_pipette.spec.layer_profile import SCHEMA, VERSION, profile_model_fields
    from megatron_pipette.spec.workload import workload_from_preset

    w = workload_from_preset("gpt3-1.3b", global_batch_size=64)
    entry = {"tensor_model_parallel_size": 1, "micro_batch_size": 1, "forward_s": 0.01, "backward_s": 0.02,
             "activation_bytes": 1 << 30}
    doc = {"schema": SCHEMA, "version": VERSION, "device": {"device_name": "cpu", "rank": 0},
           "model": profile_model_fields(w), "layers": [entry]}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    code, _, err = run(capsys, "plan", *SMALL, "--layer-profile", str(path))
    assert code == 2 and "profiled on 'cpu'" in err and "A100-80GB" in err
    doc["device"]["device_name"] = "NVIDIA A100-SXM4-80GB"
    path.write_text(json.dumps(doc))
    code, out, _ = run(capsys, "plan", *SMALL, "--layer-profile", str(path), "--top", "1",
                       "--tensor-model-parallel-size", "1")
    assert code == 0, out


def probe_sim_truth(tmp_path, mutate=None) -> str:
    from megatron_pipette.spec.cluster_file import cluster_to_json
    from megatron_pipette.spec.hardware import preset_cluster

    doc = cluster_to_json(preset_cluster("dgx-h100", num_nodes=4))
    if mutate:
        mutate(doc)
    path = tmp_path / "truth.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("mutate, extra, message", [
    (lambda d: d.update(version=7), [], "cluster schema version 7 is not supported"),
    (lambda d: d.update(num_nodes=5), [], "'nodes' must list 5 nodes"),
    (lambda d: d["devices"]["gemm_flops"].pop(), [], "devices.gemm_flops must list a finite number of at least"),
    (None, ["--world-size", "64"], "--world-size 64 --gpus-per-node 8 do not match"),
    (None, ["--noise", "-1"], "--noise must be in [0, 10.0]"),
])
def test_probe_sim_bad_input_is_one_line_and_exit_2(tmp_path, capsys, mutate, extra, message):
    truth = probe_sim_truth(tmp_path, mutate)
    argv = ["probe-sim", "--truth", truth, "--world-size", "32", "--gpus-per-node", "8", "--budget-s", "5",
            "--out", str(tmp_path / "out.json"), *extra]
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.json").exists()


def test_probe_sim_on_a_malformed_file(tmp_path, capsys):
    (tmp_path / "truth.json").write_text("{not json")
    code, _, err = run(capsys, "probe-sim", "--truth", str(tmp_path / "truth.json"), "--world-size", "8",
                       "--gpus-per-node", "8", "--out", str(tmp_path / "o.json"))
    assert code == 2 and "--truth" in err and "not valid JSON" in err


@pytest.mark.parametrize("argv, rule", [
    (["plan", "--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 does not divide the 32 GPUs"),
    (["plan", *SMALL, "--num-layers-per-virtual-pipeline-stage", "7"],
     "--num-layers-per-virtual-pipeline-stage 7 must divide the"),
    (["plan", "--num-nodes", "16384"], "--global-batch-size 1024 is not divisible by the data-parallel size"),
])
def test_no_valid_layout_is_one_line_naming_the_rule(capsys, argv, rule):
    code, out, err = run(capsys, *argv)
    assert code == 3 and out == "" and err.count("\n") == 1, err
    assert err.startswith("pipette plan: no layout of ") and rule in err, err


def test_nemos_virtual_pipeline_flag_points_to_megatrons(capsys):
    from megatron_pipette.cli.main import main
    with pytest.raises(SystemExit) as e:
        main(["plan", "--virtual-pipeline-model-parallel-size", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--num-layers-per-virtual-pipeline-stage" in err and len(err.strip().splitlines()) == 1


def test_rejections_name_the_numbers_of_a_layout_never_a_placeholder(capsys):
    """The rejection counts are kept by rule with every number an N; printed so, "> 1" read "> N" and
    "micro-batches (1) ... size 2" read "(N) ... size N". Each rule is printed as a layout broke it."""
    code, out, _ = run(capsys, "plan", *SMALL, "--num-layers-per-virtual-pipeline-stage", "2", "--top", "1")
    assert code == 0 and "--pipeline-model-parallel-size > 1" in out
    assert "the number of micro-batches (1) to be a multiple of --pipeline-model-parallel-size 2" in out
    assert not re.search(r"\bN\b", out), out


def test_the_plan_table_explains_its_abbreviations_under_it(capsys):
    code, out, _ = run(capsys, "plan", *SMALL, "--top", "3")
    lines = out.splitlines()
    legend = next(i for i, line in enumerate(lines) if line.startswith("Abbreviations: "))
    assert code == 0 and lines[legend - 1].startswith("3  tp"), lines[legend - 3:legend + 1]
    assert "dopt --use-distributed-optimizer" in lines[legend] and "lpv" not in lines[legend]


def test_an_fp8_plan_and_estimate_are_headed_with_the_precision_priced(capsys):
    """Priced with FP8 GEMMs, once headed "in bf16" alone."""
    fp8 = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--num-nodes", "1", "--fp8-format", "hybrid"]
    priced = "in bf16 with FP8 GEMMs (--fp8-format hybrid, --fp8-recipe delayed) on dgx-h100x1"
    code, out, _ = run(capsys, "plan", *fp8, "--top", "1")
    assert code == 0 and out.startswith(f"Planned llama3-8b {priced}"), out[:200]
    code, out, _ = run(capsys, "estimate", *fp8, "--tensor-model-parallel-size", "8")
    assert code == 0 and out.startswith("tp8 pp1 dp1 mbs1 in bf16 with FP8 GEMMs (--fp8-format hybrid"), out[:200]


def test_sequence_parallel_at_tp_1_is_turned_off_as_megatron_does(capsys):
    """NVIDIA's Llama 3 8B launch line types --tensor-model-parallel-size 1 with --sequence-parallel;
    Megatron's validate_args turns sequence parallelism off at TP 1, and pipette once refused it (exit 3)."""
    line = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--num-nodes", "1", "--tensor-model-parallel-size", "1",
            "--sequence-parallel"]
    said = ("--sequence-parallel with --tensor-model-parallel-size 1: priced without it, as Megatron turns sequence "
            "parallelism off at TP 1\n")
    code, out, err = run(capsys, "plan", *line, "--top", "1")
    assert code == 0 and err == "" and out.startswith(said + "Planned llama3-8b"), (err, out[:300])
    code, out, err = run(capsys, "plan", *line, "--top", "1", "--json")
    assert code == 0 and err == said and not json.loads(out)["candidates"][0]["layout"]["sequence_parallel"]
    code, out, err = run(capsys, "estimate", *line)
    assert code == 0 and out.startswith(said + "tp1 pp1 dp8 mbs1 in bf16"), out[:300]


def test_a_plan_says_which_typed_layout_flags_it_kept_fixed(capsys):
    code, out, _ = run(capsys, "plan", *SMALL, "--tensor-model-parallel-size", "2", "--micro-batch-size", "1",
                       "--top", "1")
    assert code == 0 and out.splitlines()[1] == ("Kept fixed, not searched: --tensor-model-parallel-size 2, "
                                                 "--micro-batch-size 1."), out[:400]
    code, out, _ = run(capsys, "plan", *SMALL, "--top", "1")
    assert code == 0 and "Kept fixed" not in out


def test_virtual_stages_per_rank_price_as_the_layers_per_chunk_they_build(capsys):
    """--num-virtual-stages-per-pipeline-rank 2 at 6 layers a stage is --num-layers-per-virtual-pipeline-stage 3:
    the same estimate, byte for byte; a plan typed with it keeps 2 chunks a rank."""
    base = ["estimate", "--model", "gpt3-175b", "--num-nodes", "128", "--tensor-model-parallel-size", "8",
            "--pipeline-model-parallel-size", "16", "--sequence-parallel", "--json"]
    by_layers = run(capsys, *base, "--num-layers-per-virtual-pipeline-stage", "3")
    assert by_layers[0] == 0 and run(capsys, *base, "--num-virtual-stages-per-pipeline-rank", "2") == by_layers
    plan = json.loads(run(capsys, "plan", "--model", "llama3-8b", "--cluster", "dgx-h200", "--num-nodes", "2",
                          "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                          "--top", "1", "--json")[1])
    assert plan["candidates"][0]["layout"]["num_layers_per_virtual_pipeline_stage"] == 8


def test_estimate_prices_cuda_graphs_as_megatron_takes_them(capsys):
    """--cuda-graph-impl and --cuda-graph-modules (Megatron's deprecated full_iteration module
    included) remove the host's launch floor of what they capture (cost.launch)."""
    def seconds(*graphs):
        code, out, err = run(capsys, "estimate", *SMALL, "--transformer-impl", "local", "--tensor-model-parallel-size",
                             "4", "--json", *graphs)
        assert code == 0, err
        return json.loads(out)["iteration_time_s"]
    eager = seconds()
    attention = seconds("--cuda-graph-impl", "local", "--cuda-graph-modules", "attn")
    assert eager > attention > seconds("--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "mlp")
    assert attention > seconds("--cuda-graph-impl", "none", "--cuda-graph-modules", "full_iteration")


def test_the_recipes_expert_rank_budget_and_paged_stash_are_priced(capsys):
    """Megatron-Bridge's MoE recipes' HybridEP budget and paged stash: estimated, the stash's buffer
    in the peak (1.2 x the rows in flight, against the budget's 1.5 x without it)."""
    moe = ["--model", "mixtral-8x7b", "--num-layers", "8", "--num-nodes", "1", "--gpu", "H100-80GB",
           "--expert-model-parallel-size", "8", "--moe-token-dispatcher-type", "flex",
           "--moe-flex-dispatcher-backend", "hybridep", "--use-transformer-engine-op-fuser",
           "--moe-expert-rank-capacity-factor", "1.5", "--json"]
    peaks = []
    for stash in ([], ["--moe-paged-stash", "--moe-paged-stash-buffer-size-factor-cuda", "1.2",
                       "--moe-paged-stash-buffer-size-factor-cpu", "1.0"]):
        code, out, err = run(capsys, "estimate", *moe, *stash)
        assert code == 0, err
        peaks.append(max(s["peak_bytes"] for s in json.loads(out)["memory"]["stages"]))
    assert peaks[1] < peaks[0]
