"""Resuming a checkpoint in another layout: what megatron-core 0.19 can load (spec.resume), kept by the
search and the plan check, refused in one line where nothing keeps it, and the plan each checkpoint was
saved under written with it (integration.checkpoint).

The rules are tested as pure functions over every transition between the layouts of a dense and a
mixture-of-experts model on 1 to 8 processes; the slow tier saves and resumes real Megatron
checkpoints on CPU (4 gloo processes, then 2 or 3) and holds each transition's losses to an
uninterrupted run's, or its refusal to one line."""

import json
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.megatron_args import megatron_namespace as ma_namespace
from helpers.plans import plan_doc
from megatron_pipette.errors import UnresumableCheckpoint
from megatron_pipette.integration import checkpoint
from megatron_pipette.integration import megatron_args as ma
from megatron_pipette.integration.plan_check import JobRequest, plan_problems, unresumable
from megatron_pipette.plan.search import enumerate_layouts
from megatron_pipette.report.plan_document import PlanRecord
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.resume import resume_rule
from megatron_pipette.spec.workload import workload_from_preset

DENSE = workload_from_preset("tiny-gpt")
MOE = replace(DENSE, num_experts=4, swiglu=True, add_bias_linear=False, moe_token_dispatcher_type="alltoall")
WORLDS = (1, 2, 3, 4, 8)


def layouts(workload, world: int, gpus_per_node: int = 8, **kw) -> set[Layout]:
    return {job.layout for job in enumerate_layouts(workload, world, min(world, gpus_per_node), **kw)}


def own_expert_optimizer(layout: Layout) -> bool:
    """megatron-core 0.19.2, tensor_parallel/layers.py:961-963: expert parameters leave the dense
    optimizer under EP > 1 or an expert TP size other than TP."""
    return layout.ep > 1 or (layout.tp if layout.expert_tensor_parallel_size is None
                             else layout.expert_tensor_parallel_size) != layout.tp


def loadable(workload, saved: Layout, new: Layout) -> bool:
    """What megatron-core 0.19 loads (the transition matrix below ran it): the same optimizer kind, and
    for experts the same optimizer split; TP, PP, VP, DP, EP and ETP reshard otherwise."""
    return (new.use_distributed_optimizer == saved.use_distributed_optimizer
            and (workload.num_experts is None or own_expert_optimizer(new) == own_expert_optimizer(saved)))


@pytest.mark.parametrize("workload", [DENSE, MOE], ids=["dense", "moe"])
def test_the_search_keeps_exactly_what_the_checkpoint_fixes_in_every_transition(workload) -> None:
    """Every layout saved on 1 to 8 processes, resumed on 1 to 8: the search offers exactly the valid
    layouts megatron-core can load it under, the plan check passes those and refuses the others with a
    reason, and where none is left the job is refused in one line saying what to do."""
    seen = {"refused": 0, "kept": 0}
    valid = {world: layouts(workload, world) for world in WORLDS}
    savers = {(layout.use_distributed_optimizer, own_expert_optimizer(layout)): layout
              for world in WORLDS for layout in valid[world]}   # one saved layout per property class
    assert len(savers) == (4 if workload.num_experts else 2)
    for saved in savers.values():
        rule = resume_rule(saved, moe=workload.num_experts is not None, loads_optimizer=True,
                           optimizer_sharding="fully_reshardable" if saved.use_distributed_optimizer else None)
        for world in WORLDS:
            offered = layouts(workload, world, resume=rule)
            # the saved optimizer as a typed flag (the search tries the distributed one only over DP > 1 otherwise)
            typed = layouts(workload, world, constraints={"use_distributed_optimizer": saved.use_distributed_optimizer})
            assert offered == {n for n in typed if loadable(workload, saved, n)}, (saved.describe(), world)
            request = JobRequest(workload=workload, world_size=world, gpus_per_node=min(world, 8), checkpoint=rule)
            for new in list(valid[world])[::7]:
                problems = plan_problems(PlanRecord.from_json(plan_doc(workload, new, gpus_per_node=world), "p"),
                                         request)
                assert (problems == []) == loadable(workload, saved, new), (saved.describe(), new.describe())
            why = unresumable(request, "--load ckpt (iter_0000004)")
            assert (why is None) == bool(offered)
            seen["refused" if why else "kept"] += 1
            if why:
                assert "\n" not in why and "resume on" in why and "--no-load-optim" in why
    assert seen["refused"] and seen["kept"] if workload.num_experts else not seen["refused"]


def test_the_issues_transitions() -> None:
    """4 experts saved under EP 2 restart on 3 processes (EP 1 only): refused in one line; EP 1 to EP 2
    and EP 2 to EP 1 are not offered, EP 2 to EP 4 and ETP 1 to 2 under EP 2 are."""
    saved = Layout(expert_model_parallel_size=2, data_parallel_size=4, use_distributed_optimizer=True)
    rule = resume_rule(saved, moe=True, loads_optimizer=True, optimizer_sharding="fully_reshardable")
    why = unresumable(JobRequest(workload=MOE, world_size=3, gpus_per_node=3, checkpoint=rule), "--load ckpt")
    assert why.startswith("the checkpoint in --load ckpt, saved under tp1 ep2 pp1 dp4 mbs1 dopt on 4 processes, "
                          "keeps --use-distributed-optimizer True, EP > 1 or ETP != TP, which no layout of this "
                          "model on 3 processes has"), why
    on4 = layouts(MOE, 4, resume=rule)
    assert {layout.ep for layout in on4} == {1, 2, 4} and all(layout.use_distributed_optimizer for layout in on4)
    assert {(layout.tp, layout.etp) for layout in on4 if layout.ep == 1} == {(2, 1), (4, 1)}   # ETP != TP
    assert any(layout.tp == 2 and layout.etp == 1 for layout in on4) and any(layout.tp == 2 and layout.etp == 2
                                                                               for layout in on4)
    ep1 = resume_rule(replace(saved, expert_model_parallel_size=1), moe=True, loads_optimizer=True,
                      optimizer_sharding="fully_reshardable")
    assert {layout.ep for layout in layouts(MOE, 4, resume=ep1)} == {1}
    assert {(layout.tp, layout.etp) for layout in layouts(MOE, 4, resume=ep1)} == {(1, 1), (2, 2), (4, 4)}


def saved_args(**kw) -> SimpleNamespace:
    """A checkpoint's own Megatron arguments (its common state's `args`), as validate_args left them."""
    return SimpleNamespace(**{**vars(ma_namespace()), "world_size": 4, "expert_tensor_parallel_size": 1, **kw})


def test_what_binds_is_read_from_the_checkpoints_own_arguments() -> None:
    """Megatron's arguments in the checkpoint say what a resume keeps; nothing of the optimizer binds
    where Megatron does not load it; a distributed optimizer saved dp_reshardable (Megatron's default)
    keeps TP, PP and what shapes its buffers, since Megatron refuses the change."""
    args = ma_namespace()
    moe = saved_args(num_experts=4, expert_model_parallel_size=2, use_distributed_optimizer=True)
    rule = ma.checkpoint_rule(moe, {"distrib_optim_sharding_type": "fully_reshardable"}, args)
    assert (rule.use_distributed_optimizer, rule.expert_optimizer, rule.fixed) == (True, True, ())
    assert rule.saved.describe() == "tp1 ep2 pp1 dp4 mbs1 dopt"
    for why in ({"no_load_optim": True}, {"finetune": True}):
        assert not ma.checkpoint_rule(moe, None, ma_namespace(**why)).binds
    assert not ma.checkpoint_rule(saved_args(no_save_optim=True), None, args).binds
    assert not ma.checkpoint_rule(moe, None, args, release=True).binds
    dense = ma.checkpoint_rule(saved_args(use_distributed_optimizer=True, tensor_model_parallel_size=2), None, args)
    assert dense.expert_optimizer is None and dense.equalities["tensor_model_parallel_size"] == 2  # assumed gather
    plain = ma.checkpoint_rule(saved_args(), None, args)
    assert plain.equalities == {"use_distributed_optimizer": False} and plain.fixed == ()


def test_a_typed_flag_the_checkpoint_overrides_is_said_to_be() -> None:
    rule = ma.checkpoint_rule(saved_args(), None, ma_namespace())
    argv = ["--use-distributed-optimizer", "--auto-parallel"]
    request = ma.job_request(ma_namespace(use_distributed_optimizer=True), argv, 4, 4, rule)
    assert request.constraints["use_distributed_optimizer"] is False
    assert ma.overridden_by_checkpoint(request) == (
        "--use-distributed-optimizer True ignored: the checkpoint in --load was saved with "
        "--use-distributed-optimizer False, which Megatron cannot convert; resuming with it")
    assert ma.overridden_by_checkpoint(ma.job_request(ma_namespace(), [], 4, 4, rule)) is None


def write_checkpoint(load: Path, iteration: int, plan: Layout | None = None) -> Path:
    """A --load directory as Megatron leaves it (tracker, iteration directory with its .metadata)."""
    path = load / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (load / checkpoint.CHECKPOINT_TRACKER).write_text(str(iteration))
    if plan is not None:
        checkpoint.write_plan(str(load), iteration, PlanRecord.from_json(plan_doc(DENSE, plan), "p"))
    return path


def read_with(monkeypatch, own: SimpleNamespace) -> None:
    """The checkpoint's common state, as megatron-core's reader would give it."""
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"} if own.use_distributed_optimizer else None
    monkeypatch.setattr(checkpoint, "_common_state", lambda path, where: (own, metadata))


def test_a_resume_reads_the_plan_of_the_checkpoint_it_loads(tmp_path: Path, monkeypatch) -> None:
    """The plan in the iteration's directory names the layout, not a top-level one a later start wrote
    before it saved anything (the top-level one is still read for checkpoints of earlier versions);
    --ckpt-step picks another iteration's."""
    under_a = Layout(data_parallel_size=4, micro_batch_size=4)
    under_b = Layout(data_parallel_size=4, micro_batch_size=2)
    write_checkpoint(tmp_path, 4, plan=under_a)
    (tmp_path / checkpoint.CHECKPOINT_PLAN).write_text(json.dumps(plan_doc(DENSE, replace(under_a, data_parallel_size=2,
                                                                                          micro_batch_size=8))))
    read_with(monkeypatch, saved_args())
    found = checkpoint.find_resume(ma_namespace(load=str(tmp_path)))
    assert found.saved == under_a and found.where == f"--load {tmp_path} (iter_0000004)"
    (tmp_path / "iter_0000004" / checkpoint.CHECKPOINT_PLAN).unlink()
    (tmp_path / checkpoint.CHECKPOINT_PLAN).write_text(json.dumps(plan_doc(DENSE, under_b)))
    assert checkpoint.find_resume(ma_namespace(load=str(tmp_path))).saved == under_b   # earlier versions'
    write_checkpoint(tmp_path, 2, plan=under_a)
    (tmp_path / checkpoint.CHECKPOINT_TRACKER).write_text("4")
    assert checkpoint.find_resume(ma_namespace(load=str(tmp_path), ckpt_step=2)).saved == under_a


def test_a_damaged_plan_is_set_aside_and_the_checkpoint_still_binds(tmp_path: Path, monkeypatch, capsys) -> None:
    """A damaged pipette_plan.json no longer abandons planning (it once fell back to the typed flags
    without the distributed optimizer, which cannot load the checkpoint, at every restart): it is moved
    aside with one line, and the checkpoint's own arguments say what it fixes and how it was saved."""
    path = write_checkpoint(tmp_path, 6)
    (path / checkpoint.CHECKPOINT_PLAN).write_bytes(b"\x00\xff{")
    read_with(monkeypatch, saved_args(use_distributed_optimizer=True))
    found = checkpoint.find_resume(ma_namespace(load=str(tmp_path)))
    assert found.rule.use_distributed_optimizer is True and found.saved.describe() == "tp1 pp1 dp4 mbs1 dopt"
    said = [line for line in capsys.readouterr().out.splitlines() if "auto-parallel" in line]
    assert len(said) == 1 and f"--load {path / checkpoint.CHECKPOINT_PLAN}: not a JSON file (not UTF-8 text)" in said[0]
    assert "moved aside to pipette_plan.json.corrupt-" in said[0]
    assert not (path / checkpoint.CHECKPOINT_PLAN).exists()


def test_a_plan_that_is_not_the_checkpoints_describes_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    write_checkpoint(tmp_path, 4, plan=Layout(data_parallel_size=2))
    read_with(monkeypatch, saved_args())
    assert checkpoint.find_resume(ma_namespace(load=str(tmp_path))).saved.describe() == "tp1 pp1 dp4 mbs1"
    assert "is not this checkpoint's plan" in capsys.readouterr().out


@pytest.mark.parametrize(("setup", "problem"), [
    (lambda d: (d / checkpoint.CHECKPOINT_TRACKER).write_text("latest"), "holds 'latest', not an iteration"),
    (lambda d: (d / checkpoint.CHECKPOINT_TRACKER).write_text("7"), "iter_0000007 is missing"),
    (lambda d: ((d / "iter_0000007").mkdir(), (d / checkpoint.CHECKPOINT_TRACKER).write_text("7")),
     "not a torch_dist checkpoint"),
], ids=["tracker", "missing", "legacy"])
def test_a_checkpoint_that_cannot_be_read_stops_in_one_line(tmp_path: Path, setup, problem: str) -> None:
    setup(tmp_path)
    with pytest.raises(UnresumableCheckpoint, match=problem):
        checkpoint.find_resume(ma_namespace(load=str(tmp_path)))


def test_no_checkpoint_no_resume(tmp_path: Path) -> None:
    assert checkpoint.find_resume(ma_namespace(load=None)) is None
    assert checkpoint.find_resume(ma_namespace(load=str(tmp_path))) is None
    os.mkfifo(tmp_path / checkpoint.CHECKPOINT_TRACKER)   # not a file: no checkpoint to Megatron either
    assert checkpoint.find_resume(ma_namespace(load=str(tmp_path))) is None


def test_the_resume_line_says_what_megatron_does() -> None:
    saved = Layout(expert_model_parallel_size=2, data_parallel_size=4, use_distributed_optimizer=True)
    found = checkpoint.Resume(where="--load ckpt (iter_0000004)", saved=saved, rule=resume_rule(
        saved, moe=True, loads_optimizer=True, optimizer_sharding="fully_reshardable"))
    now = replace(saved, expert_model_parallel_size=4)
    assert checkpoint.resume_line(found, saved, "ckpt").endswith(
        "(saved as tp1 ep2 pp1 dp4 mbs1 dopt) in the same layout")
    assert checkpoint.resume_line(found, now, "ckpt") == (
        "resuming the checkpoint in ckpt (saved as tp1 ep2 pp1 dp4 mbs1 dopt) in tp1 ep4 pp1 dp4 mbs1 dopt "
        "(Megatron reshards it; kept as saved: --use-distributed-optimizer True, EP > 1 or ETP != TP)")
    free = replace(found, rule=resume_rule(saved, moe=True, loads_optimizer=False, optimizer_sharding=None))
    assert "(Megatron reshards its weights; its optimizer state is not loaded)" in checkpoint.resume_line(
        free, replace(now, expert_model_parallel_size=1), "ckpt")


# --- The transition matrix: real checkpoints of Megatron on CPU (slow tier) ---------------------------

AUTO_GPT = Path(__file__).resolve().parents[2] / "examples" / "auto_parallel_cpu.sh"
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.eE+-]+)")
CHOSEN = re.compile(r"> auto-parallel: chosen layout ([^:\n]*)")
MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear",
             "--moe-token-dispatcher-type", "alltoall"]
# No dropout: a resumed run then computes what the uninterrupted one did, to the reduction order.
RUN = ["--train-iters", "6", "--save-interval", "3", "--attention-dropout", "0", "--hidden-dropout", "0",
       "--auto-parallel-check-iterations", "0"]
SAVERS = {   # 4 processes, 6 iterations, checkpoints at 3 and 6
    "dense tp2 dopt": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
    "moe ep2 dopt": [*MOE_FLAGS, "--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
    "moe ep1": [*MOE_FLAGS, "--expert-model-parallel-size", "1"],
}
TRANSITIONS = [   # saver, processes, flags typed at the resume, what it resumes under (or None: refused)
    ("dense tp2 dopt", 2, ["--pipeline-model-parallel-size", "2"], "tp1 pp2 dp1"),
    ("moe ep2 dopt", 3, [], None),                                           # EP 1 only on 3: the issue's case
    ("moe ep2 dopt", 4, ["--expert-model-parallel-size", "4"], "ep4"),
    ("moe ep2 dopt", 2, ["--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "2"], "etp2 dp2"),
    ("moe ep1", 4, ["--expert-model-parallel-size", "2"], None),             # EP 1 -> 2
    ("moe ep1", 2, [], "tp1 dp2"),
]


def losses(output: str) -> dict[int, float]:
    return {int(i): float(v) for i, v in LOSS.findall(output)}


@pytest.fixture(scope="module")
def saved(run_bounded, tmp_path_factory) -> dict[str, tuple[Path, dict[int, float]]]:
    """Each saver's run: its checkpoint directory and its losses, uninterrupted over the 6 iterations."""
    runs = {}
    for name, flags in SAVERS.items():
        root = tmp_path_factory.mktemp(name.replace(" ", "-"))
        with pytest.MonkeyPatch.context() as env:
            env.setenv("PIPETTE_CACHE_DIR", str(root / "cache"))
            env.setenv("NPROC", "4")
            out = run_bounded(["bash", str(AUTO_GPT), *RUN, *flags, "--save", str(root / "ckpt")], timeout=300)
        assert (root / "ckpt" / "iter_0000003" / checkpoint.CHECKPOINT_PLAN).is_file(), "the plan saved with it"
        assert not (root / "ckpt" / checkpoint.CHECKPOINT_PLAN).exists(), "no plan written at start"
        runs[name] = root, losses(out), CHOSEN.search(out).group(1)
    return runs


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.parametrize(("saver", "nproc", "flags", "under"), TRANSITIONS,
                         ids=[f"{s}->{n}p{' ' + ' '.join(f) if f else ''}" for s, n, f, _ in TRANSITIONS])
def test_a_transition_resumes_with_the_uninterrupted_losses_or_refuses_in_one_line(
        run_bounded, saved, tmp_path: Path, saver: str, nproc: int, flags: list[str], under: str | None) -> None:
    """The checkpoint of iteration 3 resumed on `nproc` processes logs the uninterrupted run's losses, or,
    where no layout can load it, every rank stops with one line before Megatron loads anything (no
    traceback of load_checkpoint), and so does the start torchrun's --max-restarts 1 makes again.
    Iteration 4 (the weights as loaded) to 1e-5; iteration 6 (two optimizer steps from the loaded state
    later) to 2e-3, the spread of uninterrupted runs between
    layouts (ep2 with the distributed optimizer against ep1 without: 6.3563 and 6.3654, 1.4e-3).
    Iteration 5 is not compared: Megatron 0.19 on CPU logs another loss there after any resume, in the
    saved layout too (6.685 for 6.642 uninterrupted, dense tp1 dp4, whose iterations 4 and 6 agree to
    the digit)."""
    root, uninterrupted, first = saved[saver]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(root / "ckpt" / "iter_0000003", ckpt / "iter_0000003")
    (ckpt / checkpoint.CHECKPOINT_TRACKER).write_text("3")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PIPETTE_CACHE_DIR", str(root / "cache"))
        env.setenv("NPROC", str(nproc))
        if under is None:
            env.setenv("TORCHRUN_ARGS", "--standalone --max-restarts 1")
        extra = MOE_FLAGS if saver.startswith("moe") else []
        out = run_bounded(["bash", str(AUTO_GPT), *RUN, *extra, *flags, "--load", str(ckpt), "--save", str(ckpt)],
                          timeout=300, expect_failure=under is None)
    print(f"{saver} ({first}) -> {nproc} processes {' '.join(flags)}:",
          re.findall(r"> auto-parallel: (resuming .*)", out) or re.findall(r"auto-parallel failed: .*", out)[:1],
          "losses", uninterrupted, losses(out))
    if under is None:
        first_start, restart = sorted(set(re.findall(r"auto-parallel failed: .*", out)), key=len, reverse=True)
        note = " (torchrun will restart the workers 1 more time(s), until --max-restarts is used up; a start on " \
               "the same processes stops the same way, before probing or loading anything)"
        assert first_start == restart + note and "megatron-core 0.19 cannot load it otherwise" in restart, out[-3000:]
        assert "load_checkpoint" not in out and "probed" not in out
        return
    now = CHOSEN.search(out).group(1)
    assert all(f" {part} " in f" {now} " for part in under.split()), now
    assert re.search(rf"> auto-parallel: resuming the checkpoint in {ckpt} \(saved as {re.escape(first)}\) in "
                     rf"{re.escape(now)} \(Megatron reshards it; kept as saved: ", out), out[-3000:]
    resumed = losses(out)
    assert sorted(resumed) == [4, 5, 6], resumed
    assert resumed[4] == pytest.approx(uninterrupted[4], rel=1e-5), (resumed, uninterrupted)
    assert resumed[6] == pytest.approx(uninterrupted[6], rel=2e-3), (resumed, uninterrupted)


@pytest.mark.torchrun
@pytest.mark.slow
def test_a_failed_planning_start_does_not_train_on_flags_that_cannot_resume(run_torchrun, saved, tmp_path: Path,
                                                                           monkeypatch) -> None:
    """Planning fails (one rank's probe): the flags as given, without the distributed optimizer the
    checkpoint was saved with, cannot load it, so every rank stops with one line naming why instead of
    training into Megatron's load_checkpoint (it once fell back to them at every restart)."""
    from test_autoparallel import TINY, WORKER

    root, _, _ = saved["dense tp2 dopt"]
    monkeypatch.setenv("PIPETTE_TEST_FAIL_PROBE_RANK", "1")
    monkeypatch.setenv("PIPETTE_TEST_MIN_WAIT_S", "10")
    out = run_torchrun(WORKER, [*TINY, "--tensor-model-parallel-size", "2", "--auto-parallel",
                                "--auto-parallel-cache-dir", str(tmp_path), "--auto-parallel-budget-s", "6",
                                "--load", str(root / "ckpt")], nproc=4, timeout=180, expect_failure=True)
    stops = set(re.findall(r"auto-parallel failed: .*", out))
    assert len(stops) == 1 and re.search(r"injected probe failure on rank 1.*; the flags as given cannot resume the "
                                         r"checkpoint in --load \S+ \(iter_0000006\): --use-distributed-optimizer "
                                         r"is False, the checkpoint's True", stops.pop()), out[-3000:]
    assert "GROUPS" not in out and "load_checkpoint" not in out
