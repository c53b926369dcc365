"""The probe end to end: gloo processes under torchrun on this machine's CPU.

Each test launches torchrun in its own process group with a timeout, and
kills the whole group if it runs over, so a hung rank cannot hang the suite.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_pipette.report import summarize
from megatron_pipette.spec.cluster_file import ClusterFile, cluster_from_json

pytestmark = pytest.mark.torchrun

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
DRIVER = str(Path(__file__).with_name("probe_driver.py"))
KWARGS = {"budget_s": 5.0, "precision": "bf16", "small_bytes": 4096, "large_bytes": 2**20, "repeats": 3}


def launch(nproc: int, args: list[str], *, env: dict | None = None, timeout: float = 90):
    """Run torchrun; return (returncode, stderr, wall seconds). Kills the process group on timeout."""
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"torchrun with {nproc} processes ran over {timeout} s")
    return proc.returncode, err, time.perf_counter() - start


def run_driver(tmp_path: Path, nproc: int, kwargs: dict, env: dict | None = None) -> list[dict]:
    rc, err, _ = launch(nproc, [DRIVER, str(tmp_path), json.dumps(kwargs)], env=env)
    assert rc == 0, err[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_four_ranks_complete_rank0_holds_the_document_and_the_planner_accepts_it(tmp_path):
    docs = run_driver(tmp_path, 4, KWARGS)
    assert docs[1:] == [None, None, None], "only rank 0 holds the document"
    doc = docs[0]
    cluster = cluster_from_json(doc)
    assert cluster.world_size == 4 and cluster.gpus_per_node == 4 and cluster.num_nodes == 1
    level = cluster.intra_node[0]
    off = ~np.eye(4, dtype=bool)
    assert np.all(level.bandwidth_Bps[off] > 0) and np.all(np.isfinite(level.bandwidth_Bps[off]))
    assert np.all(level.latency_s[off] >= 0)
    two_way_lat, two_way_bw = level.figures(two_way=True)
    assert np.all(two_way_bw[off] > 0) and np.all(two_way_bw[off] <= level.bandwidth_Bps[off])
    assert np.all(two_way_lat[off] >= level.latency_s[off])
    assert doc["probe"]["intra_rounds"] == doc["probe"]["intra_rounds_measured"] == 3
    assert doc["probe"]["skipped"] == []
    assert doc["precision"] == "fp32" and doc["probe"]["requested_precision"] == "bf16"
    # `pipette plan --cluster` takes the probe's file unchanged.
    path = tmp_path / "probed.json"
    path.write_text(json.dumps(doc))
    from megatron_pipette.cli.main import main

    assert main(["plan", "--model", "tiny-gpt", "--cluster", str(path), "--top", "1"]) == 0


def test_odd_world_with_a_slowed_rank(tmp_path):
    docs = run_driver(tmp_path, 3, {**KWARGS, "budget_s": 6.0}, env={"PIPETTE_PROBE_TEST_SLOW_RANK": "2"})
    doc = docs[0]
    cluster = cluster_from_json(doc)
    assert doc["probe"]["intra_rounds"] == 3 and doc["probe"]["intra_rounds_measured"] == 3
    assert np.all(cluster.intra_node[0].bandwidth_Bps[~np.eye(3, dtype=bool)] > 0)
    flops = cluster.gemm_flops
    assert int(np.argmin(flops)) == 2, flops
    assert "slowest device: rank 2" in summarize(ClusterFile.from_json(doc))


def test_a_stuck_rank_ends_the_others_within_the_timeout(tmp_path):
    rc, err, wall = launch(2, [DRIVER, str(tmp_path), json.dumps({**KWARGS, "timeout_s": 3})], timeout=60,
                           env={"PIPETTE_PROBE_TEST_STUCK_RANK": "1", "PIPETTE_PROBE_TEST_TIMEOUT_S": "3"})
    assert rc != 0
    assert not list(tmp_path.glob("rank*.json"))


def test_cli_respects_a_tiny_budget(tmp_path):
    out = tmp_path / "cluster.json"
    budget = 2.0
    rc, err, wall = launch(2, ["-m", "megatron_pipette.probe", "--out", str(out), "--budget-s", str(budget),
                               "--large-bytes", "16M", "--repeats", "1000"])
    assert rc == 0, err[-3000:]
    doc = json.loads(out.read_text())
    cluster_from_json(doc)
    assert doc["probe"]["duration_s"] <= budget
    assert doc["probe"]["skipped"], "1000 repeats of 16 MiB cannot fit in 2 s"
    assert "skipped to fit the budget" in err
    assert not [p for p in tmp_path.iterdir() if p.name != "cluster.json"]   # no temporary left


@pytest.mark.parametrize("args, flag", [(["--budget-s", "-1"], "--budget-s"), (["--backend", "nccl"], "--backend nccl"),
                                        (["--out", "{tmp}/no/c.json"], "does not exist")])
def test_cli_user_error_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, args, flag):
    """In-process: `pipette probe` (which `-m megatron_pipette.probe` runs) as a world of one."""
    from megatron_pipette.cli.main import main

    monkeypatch.delenv("RANK", raising=False)
    argv = ["probe", "--out", str(tmp_path / "c.json"), *[a.format(tmp=tmp_path) for a in args]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipette probe: rank 0: ") and flag in err and err.count("\n") == 1


def test_a_rank_lost_mid_round_ends_every_other_rank_within_the_timeout(tmp_path):
    """Three torchrun agents (one rank each, so no agent tears down the others' workers): rank 1
    dies 2 s into a probe that has rounds to run for much longer; ranks 0 and 2 must fail on
    their own, bounded by the probe's timeout, and write nothing."""
    timeout_s = 4
    env = {**os.environ, "PIPETTE_PROBE_TEST_DIE_RANK": "1", "PIPETTE_PROBE_TEST_DIE_AFTER_S": "2",
           "PIPETTE_PROBE_TEST_TIMEOUT_S": str(timeout_s)}
    port = str(29500 + os.getpid() % 1000)
    kwargs = {**KWARGS, "budget_s": 60.0, "repeats": 1000, "timeout_s": timeout_s}
    procs = [subprocess.Popen([TORCHRUN, "--nnodes=3", f"--node-rank={k}", "--nproc_per_node=1",
                               "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0", DRIVER,
                               str(tmp_path), json.dumps(kwargs)], env=env, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in range(3)]
    try:
        codes = [p.wait(timeout=90) for p in procs]      # the bound is the probe's, far inside this
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert all(code != 0 for code in codes), codes
    assert not list(tmp_path.glob("rank*.json"))
