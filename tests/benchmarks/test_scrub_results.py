"""benchmarks/scrub_results.py: which paths count as a machine's, what they become, and that packing
a run folder keeps every byte of its logs, reproducibly."""

import tarfile

import pytest

from benchmarks import scrub_results
from benchmarks.scrub_results import MACHINE_PATH, scrub

MAPS = [(b"/work/main/", b""), (b"/tmp/site/", b"<site-packages>/")]


@pytest.mark.parametrize("text", [
    'File "/work/main/megatron_pipette/profile/measure.py", line 3',
    "using CUDA_HOME='/usr/local'",
    "wrote /tmp/emu/run1/probe/cluster.json",
    "--out=/root/out/profile.json",
    "in /home/alice/ckout/x.py",
    "(0x7f in /lib/x86_64-linux-gnu/libc.so.6)",
    "Triggered internally at /__w/pytorch/pytorch/build/aten/x.h:488.",
    r'"log": "C:\\Users\\bob\\run.log"',
    "D:/runs/x.json",
])
def test_machine_paths_are_found_and_scrubbed_away(text):
    data = text.encode()
    assert MACHINE_PATH.search(data)
    clean = scrub(data, MAPS)
    assert not MACHINE_PATH.search(clean), clean
    assert scrub(clean, MAPS) == clean


@pytest.mark.parametrize("text", [
    "benchmarks/results/h100-2026-11-23-run1/log.txt",
    "out/emu-run3/tmp/x.json",
    "see https://github.com/pytorch/pytorch/pull/30531 or https://example.org/tmp/x",
    "370 GB/s, 12.5 GB/s per NIC; tp/dp/pp",
    "<venv>/lib/python3.12/site-packages/torch/x.py <tmp>/sc/loop-f1/plan.json",
    r'"step 1:\nloss 2.0", "ratio: 0.99"',
])
def test_relative_paths_urls_units_and_placeholders_are_not_machine_paths(text):
    assert not MACHINE_PATH.search(text.encode())
    assert scrub(text.encode(), MAPS) == text.encode()


def test_what_each_path_becomes():
    text = (b'File "/work/main/.venv/lib/python3.12/site-packages/torch/run.py" | /opt/torch/.venv/bin/python | '
            b"/work/main/out/emu-run1/plan.json | /tmp/site/megatron/core/x.py | /tmp/sc/loop-f1/cache | "
            b"/root/out/p.json | /home/alice/y | CUDA_HOME='/usr/local' | C:\\Users\\bob")
    assert scrub(text, MAPS) == (
        b'File "<venv>/lib/python3.12/site-packages/torch/run.py" | <venv>/bin/python | '
        b"out/emu-run1/plan.json | <site-packages>/megatron/core/x.py | <tmp>/sc/loop-f1/cache | "
        b"<home>/out/p.json | <home>/y | CUDA_HOME='<usr>/local' | <drive>\\Users\\bob")


def test_packing_keeps_every_byte_and_is_reproducible(tmp_path):
    archives = []
    for run in ("a", "b"):
        folder = tmp_path / run
        (folder / "layouts" / "tp2").mkdir(parents=True)
        (folder / "results.json").write_text('{"rows": []}')
        (folder / "layouts" / "tp2" / "node0.log").write_bytes(b"iteration 1 \xff\n" * 100)
        (folder / "layouts" / "tp2.json").write_text("{}")
        assert scrub_results.pack(folder, ["*"]) == ["layouts/tp2.json", "layouts/tp2/node0.log"]
        assert sorted(p.name for p in folder.iterdir()) == ["logs.tar.xz", "results.json"]
        archives.append((folder / "logs.tar.xz").read_bytes())
        with tarfile.open(folder / "logs.tar.xz") as tar:
            assert tar.extractfile("layouts/tp2/node0.log").read() == b"iteration 1 \xff\n" * 100
            assert {m.mtime for m in tar} == {0} and {m.uname for m in tar} == {""}
    assert archives[0] == archives[1]


def test_a_bad_map_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        scrub_results.main(["benchmarks/results", "--map", "relative=x"])
    assert "--map 'relative=x'" in capsys.readouterr().err
