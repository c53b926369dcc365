"""The emulated cluster (tools/emucluster): two namespaces joined by a shaped link; the probe finds it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.emucluster import PREFIX, EmuCluster, Spec, cleanup_stale, unavailable_reason  # noqa: E402

REASON = unavailable_reason()


def test_spec_paths() -> None:
    spec = Spec.parse({"nodes": 3, "rate_mbit": 200, "overrides": {"2": {"rate_mbit": 20, "delay_ms": 1}}})
    assert spec.expected_link(0, 1) == (25e6, 0.0)
    assert spec.expected_link(0, 2) == (2.5e6, 1e-3)
    with pytest.raises(ValueError):
        Spec.parse({"nodes": 2, "overrides": {"5": {"rate_mbit": 1}}})


@pytest.mark.torchrun
@pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")
def test_probe_finds_the_shaped_link(tmp_path: Path) -> None:
    """2 nodes x 2 processes; each node's access link is shaped to 100 Mbit/s and the probe's
    inter-node rounds run both rails at once, so each rail gets half of it (the loaded rate a
    pipeline-stage boundary sees); the node level recovers that within 25%, and every namespace
    is gone afterwards."""
    out = tmp_path / "cluster.json"
    rate = 100.0
    cl = EmuCluster({"nodes": 2, "rate_mbit": rate}, tag="t")
    with cl:
        res = cl.torchrun(["-m", "megatron_pipette.probe", "--out", str(out), "--large-bytes", "4M",
                           "--budget-s", "30"], nproc_per_node=2, timeout=55, cwd=str(REPO))
    assert all(r.returncode == 0 for r in res), "\n".join(r.output[-2000:] for r in res)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert cl.base not in names
    doc = json.loads(out.read_text())
    assert [n["host"].split("/")[-1] for n in doc["nodes"]] == ["0", "1"]
    inter = doc["inter_node"]["bandwidth_Bps"]
    per_rail = rate * 1e6 / 8 / 2
    assert all(abs(b / per_rail - 1) < 0.25 for b in (inter[0][1], inter[1][0])), (inter, per_rail)
    intra = [level["bandwidth_Bps"][0][1] for level in doc["intra_node"]]
    assert min(intra) > 3 * max(inter[0][1], inter[1][0]), (intra, inter)


@pytest.mark.torchrun
@pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")
def test_teardown_on_error_and_stale_cleanup() -> None:
    cl = EmuCluster({"nodes": 2, "rate_mbit": 50}, tag="e")
    with pytest.raises(RuntimeError), cl:
        assert cl.hub in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        raise RuntimeError("boom")
    assert cl.base not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    subprocess.run(["ip", "netns", "add", f"{PREFIX}999999999-stale"], check=True)
    assert f"{PREFIX}999999999-stale" in cleanup_stale()
