"""Elastic torchrun: a node is lost mid-training, the survivor plans for what is left and resumes.

The slow test runs it with torchrun; the others hold rank 0's part of such a restart without torch: a
new allocation made of nodes measured before reuses their probe, and takes the plan stored for the
loss of a node without a search."""

import dataclasses
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers.processes import free_port, kill_tree
from megatron_pipette.integration import replan
from megatron_pipette.integration.cache import CLUSTER, LOSS_PLAN, NODES, PLAN, PROFILE, Entry, node_index
from megatron_pipette.integration.common import Phases
from megatron_pipette.integration.plan_check import JobRequest
from megatron_pipette.probe.twin import run_twin
from megatron_pipette.spec.cluster_file import ClusterFile
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.layer_profile import SCHEMA as PROFILE_SCHEMA
from megatron_pipette.spec.layer_profile import profile_model_fields
from megatron_pipette.spec.workload import workload_from_preset

REPO = Path(__file__).resolve().parents[2]
AUTO_GPT = REPO / "examples" / "auto_parallel_cpu.sh"
ITERATION = re.compile(r"iteration\s+(\d+)/")
LOADED = re.compile(r"successfully loaded checkpoint from (\S+) .* at iteration\s+(\d+)")
CHOSEN = re.compile(r"> auto-parallel: chosen layout ([^:]+):")
PHASES = re.compile(r"> auto-parallel: phases: (.*)")
# Short rendezvous timeouts (docs/elastic.md): the lost node's keep-alive expires after 2 s x 3, the
# survivor waits 2 s for more nodes before it starts alone.
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=2,keep_alive_max_attempt=3"


class Output:
    """Lines of the agents' output (workers write to their agent's stdout), each with the time it arrived."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str, str]] = []
        self._lock = threading.Lock()

    def follow(self, name: str, proc: subprocess.Popen) -> None:
        def read() -> None:
            for line in proc.stdout:
                with self._lock:
                    self.lines.append((time.monotonic(), name, line.rstrip("\n")))
        threading.Thread(target=read, daemon=True).start()

    def since(self, start: float = 0.0, name: str | None = None) -> list[tuple[float, str]]:
        """(arrival time, line) of `name`'s lines (every agent's by default) that arrived at `start` or later."""
        with self._lock:
            return [(t, line) for t, n, line in self.lines if t >= start and name in (None, n)]

    def text(self, start: float = 0.0, name: str | None = None) -> str:
        return "\n".join(line for _, line in self.since(start, name))

    def wait_for(self, found: Callable[[], object], what: str, timeout: float, agents: dict) -> None:
        """Poll until `found()`; fail naming `what`, with the output's tail, on timeout or when every
        agent has exited."""
        deadline = time.monotonic() + timeout
        while not found():
            if time.monotonic() > deadline or all(a.poll() is not None for a in agents.values()):
                pytest.fail(f"no {what} within {timeout:.0f} s:\n{self.text()[-6000:]}")
            time.sleep(0.1)


def start_agent(port: int, hosts_store: bool, args: list[str], cache: Path, output: Output, name: str,
                nnodes: str = "1:2"):
    """One torchrun agent, 2 processes, joining a 1-to-2-node rendezvous on loopback; `hosts_store` makes
    it the one holding the c10d store (the agent that must survive)."""
    torchrun = (f"--nnodes {nnodes} --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-id elastic-test "
                f"--max-restarts 3 --rdzv-conf is_host={int(hosts_store)},{RDZV_CONF}")
    env = {**os.environ, "TORCHRUN_ARGS": torchrun, "NPROC": "2", "PYTHON": sys.executable,
           "PIPETTE_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = subprocess.Popen(["bash", str(AUTO_GPT), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output.follow(name, proc)
    return proc


def resumed(lines: list[tuple[float, str]]) -> tuple[int, float] | None:
    """(the iteration Megatron loaded, when the next one was logged), once both are in `lines`."""
    loaded = None
    for t, line in lines:
        if loaded is None:
            if load := LOADED.search(line):
                loaded = int(load.group(2))
        elif any(int(i) == loaded + 1 for i in ITERATION.findall(line)):
            return loaded, t
    return None


def processes(layout: str) -> int:
    """The processes a layout label (`tp1 pp2 dp2 mbs4 dopt`) spans: tp x cp x pp x dp."""
    return math.prod(int(size) for size in re.findall(r"\b(?:tp|cp|pp|dp)(\d+)\b", layout))


@pytest.mark.torchrun
@pytest.mark.slow
def test_the_survivor_of_a_lost_node_resumes_from_the_last_checkpoint_in_a_new_layout(tmp_path: Path) -> None:
    """Two agents of 2 processes train under a layout for 4 and checkpoint every 3 iterations; the agent
    not hosting the store is killed with its workers (a lost node). torchrun restarts the survivor's
    workers alone: the hook takes the plan the first start stored for the loss of a node, from the first
    probe and layer profile (no probe, no profile, no search), Megatron reshards the last checkpoint,
    and training goes on from the iteration after it. Prints the seconds from the kill to that iteration
    and the hook's phases on the restart (its share of it)."""
    ckpt = tmp_path / "ckpt"
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    args = ["--train-iters", "1000", "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "3"]
    port, output, agents = free_port(), Output(), {}
    try:
        for name, hosts_store in (("survivor", True), ("lost", False)):
            agents[name] = start_agent(port, hosts_store, args, tmp_path / "cache", output, name)
        output.wait_for(lambda: tracker.exists() and ITERATION.search(output.text()), "checkpoint", 100, agents)
        killed_at = time.monotonic()
        kill_tree(agents["lost"].pid)
        saved_at_kill = int(tracker.read_text())
        output.wait_for(lambda: resumed(output.since(killed_at, "survivor")), "iteration after resuming", 90,
                        agents)
        resumed_from, next_at = resumed(output.since(killed_at, "survivor"))
        saved_at_resume = int(tracker.read_text())
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                kill_tree(agent.pid)
            agent.wait()
    before, after = output.text(0), output.text(killed_at, "survivor")
    first, second = CHOSEN.search(before), CHOSEN.search(after)
    assert first and processes(first.group(1)) == 4, before[-6000:]
    assert second and processes(second.group(1)) == 2, after[-6000:]
    assert (f"> auto-parallel: resuming the checkpoint in {ckpt} (saved as {first.group(1)}) in "
            f"{second.group(1)} (Megatron reshards it; kept as saved: --use-distributed-optimizer ") in after, \
        after[-6000:]
    assert "> auto-parallel: taking the plan for the loss of a node stored in" in after, after[-6000:]
    hook = PHASES.search(after).group(1)
    assert hook.startswith("probe and profile reused"), hook
    assert LOADED.search(after).group(1) == str(ckpt)
    assert saved_at_kill <= resumed_from == saved_at_resume, (saved_at_kill, resumed_from, saved_at_resume)
    print(f"kill to iteration {resumed_from + 1} (resumed from {resumed_from} under {second.group(1)}): "
          f"{next_at - killed_at:.1f} s; the hook on the restart: {hook}; on the first start: "
          f"{PHASES.search(before).group(1)}")


@pytest.mark.torchrun
@pytest.mark.slow
def test_a_node_beside_one_probed_before_is_probed_with_its_pairs_alone(tmp_path: Path) -> None:
    """A dry run on one node of 2 processes, then one on two nodes (two agents on this machine, node
    names host/0 and host/1): the second finds host/0 in the first's probe by host, probes only what is
    new, reuses the layer profile, and plans for 4 processes."""
    cache, output = tmp_path / "cache", Output()
    port = free_port()
    first = start_agent(port, True, ["--auto-parallel-dry-run"], cache, output, "first", nnodes="1")
    assert first.wait(timeout=180) == 0, output.text()[-6000:]
    assert "> auto-parallel: probed 2 devices on 1 node(s)" in output.text(), output.text()[-6000:]
    started, port = time.monotonic(), free_port()
    agents = {name: start_agent(port, name == "a", ["--auto-parallel-dry-run"], cache, output, name, nnodes="2")
              for name in ("a", "b")}
    try:
        assert [agent.wait(timeout=180) for agent in agents.values()] == [0, 0], output.text()[-6000:]
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                kill_tree(agent.pid)
    second = output.text(started)
    assert "measured 1 of this allocation's 2 nodes: probing the 1 new one(s) and their pairs" in second, second
    assert "> auto-parallel: probed 4 devices on 2 node(s)" in second, second
    hook = PHASES.search(second).group(1)
    assert "profile reused" in hook and "probe " in hook, hook
    assert processes(CHOSEN.search(second).group(1)) == 4


TINY = dataclasses.replace(workload_from_preset("tiny-gpt"), global_batch_size=48)
FIRST, SECOND = "a" * 16, "b" * 16


def request(nodes: int, **typed) -> JobRequest:
    return JobRequest(workload=TINY, world_size=2 * nodes, gpus_per_node=2, typed=typed)


@pytest.fixture
def measured(tmp_path: Path) -> tuple[Entry, ClusterFile]:
    """The entry of a first start on three nodes of two GPUs: its probe (the twin's, with each node's
    GPUs), its layer profile, and the plan made from them (which stores the plan for a loss)."""
    return first_start(tmp_path, Phases())


def first_start(tmp_path: Path, phases: Phases) -> tuple[Entry, ClusterFile]:
    truth = preset_cluster("dgx-a100", num_nodes=3, gpus_per_node=2)
    probed = ClusterFile.from_json(run_twin(truth, budget_s=5, small_bytes=4096, large_bytes=2 ** 20,
                                            repeats=1).doc)
    entry = Entry(tmp_path, FIRST)
    entry.open()
    entry.write(CLUSTER, probed.to_json())
    entry.write(NODES, node_index(probed.node_identities))
    entry.write(PROFILE, {"schema": PROFILE_SCHEMA, "version": 1,
                          "device": {"rank": 0, "device_name": truth.gpu.name}, "model": profile_model_fields(TINY),
                          "layers": [{"tensor_model_parallel_size": tp, "micro_batch_size": 1, "forward_s": 2e-3 / tp,
                                      "backward_s": 4e-3 / tp, "activation_bytes": 500000 // tp} for tp in (1, 2)]})
    assert replan.look_up(entry, request(3), replan.Switches(), phases).plan is not None
    return entry, probed


def test_no_plan_for_a_loss_is_searched_past_the_budget(tmp_path: Path, capsys) -> None:
    """A start with no time left of --auto-parallel-budget-s plans, but stores no plan for a loss."""
    entry, _ = first_start(tmp_path, Phases(budget_s=0.0))
    assert entry.read(LOSS_PLAN) is None and entry.read(PLAN) is not None
    assert "no plan stored for the loss of a node: its search" in capsys.readouterr().out


def restart(entry: Entry, nodes, job: JobRequest, phases: Phases | None = None) -> replan.Start:
    """Rank 0's look-up at a start on `nodes` (identities), in the same cache as `entry`."""
    later = Entry(entry.root, SECOND)
    later.open()
    return replan.look_up(later, job, replan.Switches(), phases or Phases(), nodes=nodes)


def test_a_restart_after_a_loss_takes_the_stored_plan_without_probe_or_search(measured, monkeypatch, capsys):
    """Nodes 2 and 0 survive the loss of node 1: their figures come from the first probe, the layer
    profile is the first one's, and the plan is the loss plan's layouts placed on them, checked."""
    entry, probed = measured
    loss = entry.read(LOSS_PLAN)
    assert loss.world_size == 4
    monkeypatch.setattr(replan, "plan", lambda *a, **k: pytest.fail("searched"))
    capsys.readouterr()
    phases = Phases()
    start = restart(entry, [probed.node_identities[2], probed.node_identities[0]], request(2), phases)
    assert start.plan is not None and start.plan.world_size == 4
    assert start.plan.best.layout in [c.layout for c in loss.candidates]
    assert phases.skipped == {"probe": "reused", "profile": "reused"} and "plan" in phases.seconds
    assert "taking the plan for the loss of a node" in capsys.readouterr().out
    start.caching.join()        # the survivors' figures, written beside the plan
    later = Entry(entry.root, SECOND)
    kept = later.read(CLUSTER)
    assert kept.cluster.hosts == (probed.cluster.hosts[2], probed.cluster.hosts[0])
    assert kept.cluster.inter_node.bandwidth_Bps[0, 1] == probed.cluster.inter_node.bandwidth_Bps[2, 0]
    assert later.read(PLAN).to_json() == start.plan.to_json() and later.read(PROFILE) is not None
    survivors = [probed.node_identities[2], probed.node_identities[0]]
    assert later.read(NODES) == frozenset(node_index(survivors)["digests"])    # found by host at the next loss


def test_a_loss_plan_the_job_cannot_take_is_searched_again_from_the_reused_probe(measured, capsys):
    """A flag typed at the restart that none of the loss plan's layouts keeps: the plan check says why,
    and the survivors are planned by a search, still without a probe."""
    entry, probed = measured
    capsys.readouterr()
    start = restart(entry, probed.node_identities[:2], request(2, pipeline_model_parallel_size=2))
    out = capsys.readouterr().out
    assert "loss_plan.json cannot run this job" in out and "planning from the probe and layer profile" in out
    assert start.plan is not None and start.plan.best.layout.pp == 2


def test_an_allocation_with_a_node_never_measured_probes_that_node_and_reuses_the_rest(measured):
    """One node unknown (another machine, or the same host with other GPUs): the probe runs, told which
    nodes were measured before (Start.known_nodes, for every rank) and where they are in that probe;
    the layer profile is reused."""
    entry, probed = measured
    other = dataclasses.replace(probed.node_identities[1], gpus=("GPU-x", "GPU-y"))
    phases = Phases()
    start = restart(entry, [probed.node_identities[2], other, probed.node_identities[0]], request(3), phases)
    assert start.plan is None and start.cluster is None and start.profile is not None
    assert Entry(entry.root, SECOND).read(PROFILE) is not None and phases.skipped == {"profile": "reused"}
    assert start.known_nodes == [True, False, True] and start.known_where == (2, None, 0)
    assert start.known.to_json() == probed.to_json()
