"""--auto-parallel inside Megatron's own argument handling: plan, re-rank, fall back."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.checkpoints import write_checkpoint
from helpers.plans import chosen
from helpers.processes import free_port, kill_tree
from megatron_pipette.integration.groups import expected_groups, group_sizes

WORKER = Path(__file__).with_name("autoparallel_worker.py")
REPO = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "16",
        "--vocab-size", "1024", "--tokenizer-type", "NullTokenizer", "--train-iters", "10",
        "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
        "--distributed-backend", "gloo", "--lr", "1e-3", "--mock-data"]


def groups_of(output: str) -> dict[int, dict]:
    """The workers' reports; ranks print concurrently, so lines can run together."""
    decoder = json.JSONDecoder()
    reports = [decoder.raw_decode(output, m.end())[0] for m in re.finditer(r"GROUPS (?=\{)", output)]
    return {r["physical"]: r for r in reports}


def two_node_torchrun(args: list[str], timeout: float = 240) -> str:
    """Two torchrun agents on this host, 2 processes each: two 'nodes' to the probe."""
    port = free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", "pipette-test", str(WORKER), *args],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for node in (0, 1)]
    outputs = []
    deadline = time.monotonic() + timeout
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        pytest.fail("two-node torchrun timed out")
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_tree(agent.pid)  # its workers too: each runs in a session of its own
    assert all(a.returncode == 0 for a in agents), "\n".join(o[-3000:] for o in outputs)
    return "\n".join(outputs)


def check_groups(output: str, doc: dict) -> tuple:
    layout, placement = chosen(doc)
    got = groups_of(output)
    want = expected_groups(placement.logical_to_physical.tolist(), **group_sizes(layout))
    assert sorted(got) == sorted(want)
    for physical, groups in want.items():
        assert {k: got[physical][k] for k in ("tp", "pp", "dp")} == {k: groups[k] for k in ("tp", "pp", "dp")}, physical
        assert got[physical]["layout"] == [layout.tp, layout.pp, layout.dp]
    return layout, placement


def cached_plan(cache: Path) -> Path:
    (plan_file,) = cache.glob("*/plan.json")
    return plan_file


@pytest.fixture(scope="module")
def restarted_job(run_bounded, tmp_path_factory) -> tuple[str, Path]:
    """One launch, several tests: the first attempt probes, profiles and plans in the job and
    Megatron builds its groups; then rank 0 crashes, torchrun restarts the worker group, and the
    hook starts over on the same store under new prefixes. Returns (output, cache dir)."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PIPETTE_TEST_CRASH_FIRST_ATTEMPT", "1")
        out = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           "--max-restarts", "1", str(WORKER), *TINY, "--auto-parallel",
                           "--auto-parallel-cache-dir", str(cache), "--auto-parallel-budget-s", "60"], timeout=300)
    return out, cache


@pytest.mark.torchrun
def test_planned_groups_follow_the_placement(restarted_job) -> None:
    """Probe, profile and plan in the job; Megatron's groups are the plan's, process by process."""
    out, cache = restarted_job
    assert "> auto-parallel: probed 4 devices" in out
    assert "> auto-parallel: chosen layout" in out
    check_groups(out, json.loads(cached_plan(cache).read_text()))


@pytest.mark.torchrun
def test_a_dry_run_reuses_the_cached_plan(run_torchrun, restarted_job) -> None:
    """The same allocation again: the cached plan is reused, probe and profile are skipped;
    a dry run stops before Megatron builds anything."""
    _, cache = restarted_job
    plan_file = cached_plan(cache)
    again = run_torchrun(WORKER, [*TINY, "--auto-parallel", "--auto-parallel-cache-dir", str(cache),
                                  "--auto-parallel-dry-run"], nproc=4, timeout=240)
    assert f"using the plan in {plan_file}" in again and "probed" not in again
    assert "GROUPS" not in again


@pytest.mark.torchrun
def test_a_restart_reuses_its_plan_and_a_plan_for_another_job_is_not_applied(run_torchrun, tmp_path: Path) -> None:
    """The same command restarted from its checkpoint finds the plan it saved under (the checkpoint is no
    part of the cache key: it once re-probed and switched layout), says which layout the checkpoint
    was saved under and which it resumes under, and says that probe, profile and plan were cached. A
    plan pinned for another global batch (Megatron's validate_args once killed every rank on it) is
    one warning, and the job goes on with a plan that runs."""
    ckpt, cache = tmp_path / "ckpt", tmp_path / "cache"
    line = [*TINY, "--auto-parallel", "--auto-parallel-cache-dir", str(cache), "--save", str(ckpt), "--load", str(ckpt),
            "--save-interval", "1000"]
    first = run_torchrun(WORKER, line, nproc=2, timeout=240)
    assert "> auto-parallel: probed 2 devices" in first
    doc = json.loads(cached_plan(cache).read_text())
    write_checkpoint(ckpt, 10, chosen(doc)[0], 2)   # as Megatron's save under the plan leaves it
    other = json.loads(json.dumps(doc))
    other["model"]["global_batch_size"], other["candidates"][0]["layout"]["micro_batch_size"] = 48, 3
    (tmp_path / "other.json").write_text(json.dumps(other))
    again = run_torchrun(WORKER, [*line, "--auto-parallel-plan-file", str(tmp_path / "other.json")], nproc=2,
                         timeout=240)
    said = "\n".join(re.findall(r"> auto-parallel: .*", again))
    assert said.count("WARNING") == 1 and re.search(
        r"WARNING: the plan in \S+other.json cannot run this job \(--global-batch-size 48 in the plan, 16 here; "
        r"--micro-batch-size is 3 in the plan, 1 fixed here\): planning again", said), said
    assert f"using the plan in {cached_plan(cache)}" in again and "probed" not in again
    layout = chosen(doc)[0].describe()
    assert f"> auto-parallel: resuming the checkpoint in {ckpt} (saved as {layout}) in the same layout" in again
    assert "> auto-parallel: phases: probe, profile and plan cached; total" in again, said
    check_groups(again, doc)


@pytest.mark.torchrun
def test_pinned_plan_swapping_nodes_reranks_processes(tmp_path: Path) -> None:
    """A plan that puts logical node 0 on physical node 1 renumbers every process accordingly."""
    from megatron_pipette.cost.model import CostModel
    from megatron_pipette.plan.planner import plan
    from megatron_pipette.report.plan_document import plan_json
    from megatron_pipette.spec.hardware import preset_cluster
    from megatron_pipette.spec.workload import workload_from_preset

    # The model of TINY's flags (a plan for another model is not applied), with its typed micro-batch size.
    model = workload_from_preset("tiny-gpt", max_position_embeddings=64, attention_backend="local")
    result = plan(model, CostModel(preset_cluster("dgx-a100", num_nodes=2, gpus_per_node=2)),
                  constraints={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                               "micro_batch_size": 1})
    doc = plan_json(result)
    doc["candidates"][0]["placement"]["node_order"] = [1, 0]
    pinned = tmp_path / "plan.json"
    pinned.write_text(json.dumps(doc))
    out = two_node_torchrun([*TINY, "--auto-parallel", "--auto-parallel-plan-file", str(pinned),
                             "--auto-parallel-cache-dir", str(tmp_path / "cache")])
    layout, placement = check_groups(out, doc)
    assert placement.node_order == (1, 0) and layout.tp == 2 and layout.pp == 2
    # Physical ranks 2 and 3 (node 1) now hold logical ranks 0 and 1: the first pipeline stage.
    assert {groups_of(out)[p]["rank"] for p in (2, 3)} == {0, 1}


@pytest.mark.torchrun
def test_probe_failure_falls_back_to_the_users_flags(run_torchrun, tmp_path: Path, monkeypatch) -> None:
    """One rank's probe fails: every rank warns and trains with the flags as given; none hangs.
    The others wait out the probe group's timeout, max(MIN_WAIT_S, 1.5 x budget): 30 s as shipped,
    10 s with the floor lowered to 10 s and a 6 s budget."""
    monkeypatch.setenv("PIPETTE_TEST_FAIL_PROBE_RANK", "1")
    monkeypatch.setenv("PIPETTE_TEST_MIN_WAIT_S", "10")
    out = run_torchrun(WORKER, [*TINY, "--tensor-model-parallel-size", "2", "--auto-parallel",
                                "--auto-parallel-cache-dir", str(tmp_path), "--auto-parallel-budget-s", "6"],
                       nproc=4, timeout=180)
    assert re.search(r"WARNING: planning failed \(.*rank 1: RuntimeError: injected probe failure on rank 1", out), \
        out[-3000:]
    got = groups_of(out)
    assert sorted(got) == [0, 1, 2, 3]
    assert all(r["layout"] == [2, 1, 2] and r["rank"] == p for p, r in got.items())


@pytest.mark.torchrun
@pytest.mark.slow
def test_a_rank_that_hangs_while_rank_0_profiles_stops_every_other_within_the_bound(run_torchrun, tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """Rank 1 stops (SIGSTOP: hung, its sockets open, so no peer hears of it from the network) while rank 0
    profiles. Every other rank ends the pre-launch phase within the documented bound after the stop, the
    budget plus 3 x max(MIN_WAIT_S, 1.5 x budget) (rank 0's remaining work, one wait in a collective, the
    final agreement): 36 s with the floor lowered to 10 s and a 6 s budget. Each stops with one line
    naming rank 1 (no training group can form without it); no raw DistStoreError."""
    monkeypatch.setenv("PIPETTE_TEST_STOP_RANK", "1")
    monkeypatch.setenv("PIPETTE_TEST_MIN_WAIT_S", "10")
    out = run_torchrun(WORKER, [*TINY, "--auto-parallel", "--auto-parallel-cache-dir", str(tmp_path),
                                "--auto-parallel-budget-s", "6"], nproc=3, timeout=240, expect_failure=True)
    stopped = float(re.search(r"STOPPED 1 ([0-9.]+)", out).group(1))
    exited = {int(r): float(t) for r, t in re.findall(r"EXITED (\d+) ([0-9.]+)", out)}
    print(f"rank 1 stopped; ranks 0 and 2 ended {exited[0] - stopped:.1f} s and {exited[2] - stopped:.1f} s later "
          "(bound 36 s)")
    assert max(exited[0], exited[2]) - stopped <= 36, (exited, stopped)
    lines = re.findall(r"auto-parallel failed: .*", out)
    assert len(lines) == 2 and all(line == "auto-parallel failed: rank 1: no answer within 20 s (hung or dead)"
                                   for line in lines), lines
    assert "DistStoreError" not in out and "GROUPS" not in out


@pytest.mark.torchrun
def test_a_flag_the_planner_cannot_price_falls_back_or_stops(run_torchrun, tmp_path: Path) -> None:
    """--no-overlap-p2p-communication is not modelled: before any probe, every rank keeps the user's flags with one
    warning naming the flag, or, under --auto-parallel-strict, every rank stops. The micro-batch size the
    user left to the planner (Megatron cannot start without one) becomes 1, and the warning says so."""
    i = TINY.index("--micro-batch-size")
    args = [*TINY[:i], *TINY[i + 2:], "--no-overlap-p2p-communication", "--auto-parallel",
            "--auto-parallel-cache-dir", str(tmp_path)]
    out = run_torchrun(WORKER, args, nproc=2, timeout=180)
    reason = "rank 0,1: --no-overlap-p2p-communication: the model prices Megatron's default pipeline schedules"
    assert f"> auto-parallel: WARNING: planning failed ({reason}); training with the flags as given " \
           "(--micro-batch-size, not given: 1): tp1 pp1 dp2 mbs1\n" in out, out[-3000:]
    assert out.count("WARNING: planning failed") == 1 and "probed" not in out
    got = groups_of(out)
    assert sorted(got) == [0, 1] and all(r["layout"] == [1, 1, 2] and r["rank"] == p for p, r in got.items())
    stopped = run_torchrun(WORKER, [*args, "--auto-parallel-strict"], nproc=2, timeout=180, expect_failure=True)
    assert stopped.count(f"auto-parallel failed (--auto-parallel-strict): {reason}") == 2, stopped[-3000:]
    assert "GROUPS" not in stopped


@pytest.mark.torchrun
def test_elastic_restart_plans_again_under_fresh_prefixes(restarted_job) -> None:
    """After torchrun's restart the hook finds the plan cached for this allocation, and every
    process gets its groups again."""
    out, cache = restarted_job
    assert out.count("> auto-parallel: probed 4 devices") == 1
    assert "using the plan in" in out
    assert len(re.findall(r"GROUPS \{", out)) == 8  # 4 processes, twice
    check_groups(out, json.loads(cached_plan(cache).read_text()))


AUTO_GPT = REPO / "examples" / "auto_parallel_cpu.sh"
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.eE+-]+|nan|inf)")
CHOSEN = re.compile(r"> auto-parallel: chosen layout (tp\d+ pp\d+ dp\d+)")


@pytest.mark.torchrun
@pytest.mark.slow
def test_resume_on_a_smaller_allocation_replans(run_bounded, tmp_path: Path, monkeypatch) -> None:
    """4 processes train and save under one layout with the distributed optimizer (and full
    recomputation, which no other test runs through Megatron); 2 processes
    resume under the layout the planner picks for 2 (keeping the distributed optimizer, whose
    state must reshard), from the saved iteration, with finite, still-falling loss."""
    pytest.importorskip("psutil")  # megatron's torch_dist checkpoint writer needs it
    monkeypatch.setenv("PIPETTE_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = ["--train-iters", "10", "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"),
            "--save-interval", "1000"]
    first = run_bounded(["bash", str(AUTO_GPT), *ckpt, "--tensor-model-parallel-size", "2",
                         "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                         "--recompute-granularity", "full", "--recompute-method", "uniform",
                         "--recompute-num-layers", "1", "--exit-interval", "6"], timeout=240)
    monkeypatch.setenv("NPROC", "2")
    second = run_bounded(["bash", str(AUTO_GPT), *ckpt], timeout=240)
    before = {int(i): float(v) for i, v in LOSS.findall(first)}
    after = {int(i): float(v) for i, v in LOSS.findall(second)}
    assert CHOSEN.search(first).group(1).endswith("dp1")  # tp2 pp2 on 4
    replanned = CHOSEN.search(second).group(1)
    assert "dp" in replanned and replanned != CHOSEN.search(first).group(1)
    assert re.search(rf"> auto-parallel: resuming the checkpoint in {tmp_path / 'ckpt'} \(saved as "
                     rf"{CHOSEN.search(first).group(1)}[^)]*\) in {replanned} .*\(Megatron reshards it; kept as "
                     r"saved: --use-distributed-optimizer True\)", second)
    chosen_lines = [re.search(r"> auto-parallel: chosen layout [^\n]*", out).group(0) for out in (first, second)]
    assert all("--use-distributed-optimizer" in line for line in chosen_lines), chosen_lines
    assert "--recompute-granularity full" in chosen_lines[0], chosen_lines
    assert sorted(before) == list(range(1, 7)) and sorted(after) == list(range(7, 11))
    assert all(v == v and v < float("inf") for v in after.values())
    assert after[7] < before[1] - 0.2 and after[10] < after[7], (before, after)


@pytest.mark.torchrun
def test_mixture_of_experts_trains_under_a_spelt_out_interleaved_layout(run_bounded, tmp_path: Path,
                                                                         monkeypatch) -> None:
    """Megatron's MoE layer with the all-to-all dispatcher, 4 SwiGLU experts over EP 2, and
    --pipeline-model-parallel-layout Et|t|t|tL over PP 2 (the embedding and one layer, a layer, a layer,
    a layer and the loss: two chunks per stage), all typed, the rest planned: the hook applies the
    plan, Megatron accepts the flags, builds the interleaved pipeline, the expert groups the log names
    and, on every pipeline rank, as many parameters as the plan priced there (MoE layers, not dense
    ones: the example once built dense layers whatever --num-experts said), and the loss falls.
    (One launch for both: every launch costs ~25 s of start-up on 2 cores.)"""
    monkeypatch.setenv("PIPETTE_CACHE_DIR", str(tmp_path / "cache"))
    out = run_bounded(["bash", str(AUTO_GPT), "--train-iters", "6", "--num-experts", "4", "--moe-router-topk", "2",
                       "--swiglu", "--disable-bias-linear", "--moe-token-dispatcher-type", "alltoall",
                       "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--pipeline-model-parallel-layout", "Et|t|t|tL"], timeout=240)
    (plan_file,) = (tmp_path / "cache").glob("*/plan.json")
    priced = [s["parameters"] for s in json.loads(plan_file.read_text())["candidates"][0]["memory"]["stages"]]
    built = {int(p): int(n) for p, n in re.findall(r"number of parameters on \(tensor, gtp_weight_remat, "
                                                   r"pipeline\) model parallel rank \(0, 0, (\d+)\): (\d+)", out)}
    assert built == dict(enumerate(priced)) and len(built) == 2, (built, priced)
    chosen = re.search(r"> auto-parallel: chosen layout ([^:\n]*)", out).group(1)
    assert all(f" {part} " in f" {chosen} " for part in ("ep2", "pp2", "layout=Et|t|t|tL")), chosen
    groups = re.search(r"> auto-parallel: expert-parallel groups \(torchrun ranks\): (.*)", out).group(1)
    assert sorted(len(g.split(",")) for g in re.findall(r"\[([^\]]*)\]", groups)) == [2, 2], groups
    losses = {int(i): float(v) for i, v in LOSS.findall(out)}
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1] - 0.2, losses
