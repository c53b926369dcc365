"""The cache directory's owner (integration.cache), torch-free: a bad file affects only itself, writes
are atomic and private, an unsafe directory is refused, concurrent jobs take turns, and a start plans
with whatever of the cache is still good."""

import dataclasses
import errno
import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from helpers.clusters import cpu_like
from helpers.plans import plan_doc
from megatron_pipette import files
from megatron_pipette.errors import PipetteError
from megatron_pipette.integration import replan
from megatron_pipette.integration.cache import CALIBRATION, CLUSTER, LOCK, PLAN, PROFILE, Entry, cache_key
from megatron_pipette.integration.common import Phases
from megatron_pipette.integration.plan_check import JobRequest
from megatron_pipette.spec.cluster_file import cluster_to_json
from megatron_pipette.spec.layer_profile import SCHEMA as PROFILE_SCHEMA
from megatron_pipette.spec.layer_profile import ProfileFile, profile_model_fields
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.resume import ResumeRule
from megatron_pipette.spec.workload import workload_from_preset

TINY = workload_from_preset("tiny-gpt")
REQUEST = JobRequest(workload=TINY, world_size=4, gpus_per_node=4, typed={"sequence_parallel": False})
PROFILE_DOC = {"schema": PROFILE_SCHEMA, "version": 1, "device": {"rank": 0, "device_name": "cpu"},
               "model": profile_model_fields(TINY),
               "layers": [{"tensor_model_parallel_size": tp, "micro_batch_size": 1, "forward_s": 2e-3 / tp,
                           "backward_s": 4e-3 / tp, "activation_bytes": 500000 // tp} for tp in (1, 2, 4)]}
CALIBRATION_DOC = {"schema": "megatron-pipette/calibration", "version": 1, "id": "c0ffee",
                   "factors": {"compute_rate": 0.5, "memory_rate": 1.0, "link_bandwidth": {"intra_node": 0.5},
                               "memory_overhead_bytes": 0},
                   "fitted_on": {"layout": dataclasses.asdict(Layout()), "measured_s": 0.2, "predicted_s": 0.1}}
DOCS = {"plan": (PLAN, {**plan_doc(TINY, Layout(data_parallel_size=4, micro_batch_size=4)),
                        "calibration": {"id": "c0ffee", "factors": CALIBRATION_DOC["factors"]}}),  # made with it
        "cluster": (CLUSTER, {**cluster_to_json(cpu_like(), "fp32"), "device_name": "cpu"}),
        "profile": (PROFILE, PROFILE_DOC),
        "calibration": (CALIBRATION, CALIBRATION_DOC)}


def bad_contents(good: dict) -> dict[str, bytes]:
    """Each way a cache file goes bad."""
    text = json.dumps(good).encode()
    return {"truncated": text[:len(text) // 2], "binary": bytes(range(256)) * 4,
            "wrong schema": json.dumps({**good, "schema": "someone-else/plan"}).encode(),
            "old version": json.dumps({**good, "version": 0}).encode(), "empty": b"",
            "not an object": b"[1, 2, 3]", "nested too deep": b"[" * 100000,
            "a field of the wrong type": json.dumps({**good, **{k: None for k in good if k not in
                                                               ("schema", "version")}}).encode()}


@pytest.fixture
def entry(tmp_path: Path) -> Entry:
    e = Entry(tmp_path / "cache", "k")
    e.open()
    return e


def fill(entry: Entry, *kinds: str) -> None:
    for kind in kinds:
        doc, value = DOCS[kind]
        assert entry.write(doc, value)


def set_aside(entry: Entry, doc) -> list[Path]:
    return sorted(entry.path.glob(f"{doc.name}.corrupt-*"))


@pytest.mark.parametrize("kind", DOCS)
@pytest.mark.parametrize("failure", bad_contents({"schema": "x", "version": 1}))
def test_a_bad_file_is_moved_aside_once_with_one_warning(entry: Entry, kind: str, failure: str, capsys) -> None:
    doc, good = DOCS[kind]
    entry.file(doc).write_bytes(bad_contents(good)[failure])
    assert entry.read(doc) is None
    out = capsys.readouterr().out
    assert out.count("WARNING") == 1 and f"moved aside to {doc.name}.corrupt-" in out, out
    assert doc.without in out and "\n" not in out.strip()
    assert not entry.file(doc).exists() and len(set_aside(entry, doc)) == 1
    assert entry.read(doc) is None and capsys.readouterr().out == ""    # gone: nothing more to say
    assert entry.write(doc, good) and entry.read(doc) is not None


def test_a_reader_tripping_on_a_malformed_field_sets_only_that_file_aside(entry: Entry, capsys) -> None:
    """Whatever a document's reader raises on a malformed field (here a profile whose device is null),
    the file is set aside like any other bad file."""
    entry.file(PROFILE).write_text(json.dumps({**PROFILE_DOC, "device": None}))
    assert entry.read(PROFILE) is None and len(set_aside(entry, PROFILE)) == 1
    assert capsys.readouterr().out.count("WARNING") == 1


@pytest.mark.parametrize("kind", DOCS)
def test_a_directory_in_place_of_a_file_is_moved_aside(entry: Entry, kind: str, capsys) -> None:
    doc, _ = DOCS[kind]
    entry.file(doc).mkdir()
    assert entry.read(doc) is None and len(set_aside(entry, doc)) == 1
    assert "not a regular file (a directory)" in capsys.readouterr().out


HANG_S = 30.0
"""How long a read may block before the test calls it hung (a FIFO without a writer blocks forever)."""


def read_unhung(read, fifo: Path | None = None):
    """`read()`'s value (or the error it raised), and whether it blocked: a read hung on the FIFO
    `fifo` past HANG_S is released (a writer that closes at once ends the file) so the test ends."""
    box = {}

    def run() -> None:
        try:
            box["value"] = read()
        except Exception as e:  # noqa: BLE001 (handed to the test)
            box["value"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    hung = thread.is_alive()
    if hung and fifo is not None:
        os.close(os.open(fifo, os.O_WRONLY))
        thread.join()
    return box.get("value"), hung


@pytest.mark.parametrize("kind", DOCS)
@pytest.mark.parametrize("what, why", [
    ("a link out of the cache", "a symbolic link, not a regular file"),
    ("a link to /dev/null", "a symbolic link, not a regular file"),
    ("a FIFO", "not a regular file (a FIFO)"),
    ("over the size bound", "bytes, over the"),
])
def test_only_regular_files_of_the_entry_are_read(entry: Entry, kind: str, what: str, why: str, tmp_path: Path,
                                                  monkeypatch, capsys) -> None:
    """(issue 33) A cached file must be a regular file inside the entry, of a bounded size: a link is
    never followed (it is moved aside, what it points to is left alone), a FIFO does not block the
    start, and no file is read past files.MAX_DOCUMENT_BYTES (a link to /dev/zero read until memory
    ran out)."""
    doc, good = DOCS[kind]
    path, text = entry.file(doc), json.dumps(good)
    theirs = tmp_path / "theirs.json"
    theirs.write_text(text)
    if what == "a link out of the cache":
        path.symlink_to(theirs)
    elif what == "a link to /dev/null":
        path.symlink_to(os.devnull)
    elif what == "a FIFO":
        os.mkfifo(path)
    else:
        path.write_text(text)
        monkeypatch.setattr(files, "MAX_DOCUMENT_BYTES", len(text) - 1)
    value, hung = read_unhung(lambda: entry.read(doc), path if what == "a FIFO" else None)
    assert not hung and value is None
    out = capsys.readouterr().out
    assert out.count("WARNING") == 1 and why in out and f"moved aside to {doc.name}.corrupt-" in out, out
    assert len(set_aside(entry, doc)) == 1 and theirs.read_text() == text
    monkeypatch.undo()
    assert entry.write(doc, good) and entry.read(doc) is not None and theirs.read_text() == text


def test_an_entry_linked_out_of_the_cache_is_moved_aside_and_nothing_it_points_to_is_touched(
        tmp_path: Path, capsys) -> None:
    """(issue 33) An entry that is a symbolic link to a user's directory (planted in a team's cache, or
    a careless `ln -s`) had its calibration.json deleted and its plan.json renamed by a start: the
    link is moved aside with one warning, the entry made afresh, and the directory left as it was."""
    theirs = tmp_path / "their project"
    theirs.mkdir()
    for doc, value in DOCS.values():
        (theirs / doc.name).write_text(json.dumps(value))
    (theirs / CLUSTER.name).write_bytes(b"\x00garbage")     # one to set aside, were it read
    before = {p.name: p.read_bytes() for p in theirs.iterdir()}
    team = tmp_path / "team"
    team.mkdir()
    (team / "k").symlink_to(theirs)
    e = Entry(team, "k", shared=True)
    e.open()
    out = capsys.readouterr().out
    assert out.count("WARNING") == 1 and f"the entry {e.path} is a symbolic link to {theirs}" in out, out
    assert "moved aside to k.corrupt-" in out and e.path.is_dir() and not e.path.is_symlink()
    assert start(e) == replan.Start()     # nothing cached: everything is measured again
    fill(e, "cluster", "profile", "calibration")
    replan.plan_measured(REQUEST, e, Phases(), cpu_like(), ProfileFile.from_json(PROFILE_DOC).profile,
                         {PROFILE: PROFILE_DOC})
    assert {p.name: p.read_bytes() for p in theirs.iterdir()} == before


def test_a_teams_lock_is_group_writable_whatever_the_umask(tmp_path: Path) -> None:
    """(issue 33) The lock file was created 0640 under a umask of 027, so another member of the group
    could not open it and planned without the lock."""
    old = os.umask(0o027)
    try:
        e = Entry(tmp_path / "team", "k", shared=True)
        e.open()
        with e.locked(1.0):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE((e.path / LOCK).stat().st_mode) == 0o660


def test_a_dangling_link_as_the_cache_is_refused_in_one_line(tmp_path: Path) -> None:
    """(issue 33) A dangling symbolic link as the cache directory abandoned planning with a raw
    FileNotFoundError; it is one line naming the option (or the variable) that chose it."""
    root = tmp_path / "cache"
    root.symlink_to(tmp_path / "gone")
    for flag in ("--auto-parallel-cache-dir", "PIPETTE_CACHE_DIR"):
        with pytest.raises(PipetteError) as error:
            Entry(root, "k", flag=flag).open()
        message = str(error.value)
        assert message.startswith(f"{flag} {root}: ") and f"a symbolic link to {tmp_path / 'gone'}" in message
        assert "\n" not in message


def failing_write(error: int):
    def write(fd: int, data: bytes) -> None:
        os.write(fd, data[:len(data) // 2])
        raise OSError(error, os.strerror(error))
    return write


@pytest.mark.parametrize("kind", DOCS)
@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EROFS], ids=["full", "read-only"])
def test_a_write_that_fails_warns_once_and_leaves_the_old_file(entry: Entry, kind: str, error: int, monkeypatch,
                                                               capsys) -> None:
    """A full disk or a read-only cache: the old file stays whole, no temporary file is left, and
    one warning says the job goes on uncached (as root, chmod cannot make a directory read-only)."""
    doc, good = DOCS[kind]
    fill(entry, kind)
    before = entry.file(doc).read_bytes()
    monkeypatch.setattr(files, "_write_all", failing_write(error))
    assert not entry.write(doc, {**good, "changed": True})
    assert not entry.write(doc, {**good, "changed": True})
    out = capsys.readouterr().out
    assert out.count("WARNING") == 1 and os.strerror(error) in out and "--auto-parallel-cache-dir" in out, out
    assert entry.file(doc).read_bytes() == before
    assert sorted(p.name for p in entry.path.iterdir()) == [doc.name]


def test_a_cache_that_cannot_be_created_is_a_warning_and_an_empty_cache(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("")
    e = Entry(tmp_path / "file" / "cache", "k")
    e.open()
    assert e.read(PLAN) is None and not e.write(*DOCS["plan"])
    out = capsys.readouterr().out
    assert out.count("WARNING") == 1 and "--auto-parallel-cache-dir" in out and "cannot create" in out


def test_files_and_directories_are_private_and_written_through_fresh_names(tmp_path: Path, monkeypatch) -> None:
    """0700 directories and 0600 files whatever the umask; a planted temporary name or link is never
    written through (tempfile.mkstemp); a team's cache is group-writable."""
    monkeypatch.setattr(os, "umask", os.umask)
    old = os.umask(0)
    try:
        e = Entry(tmp_path / "a" / "cache", "k")
        e.open()
        victim = tmp_path / "victim"
        victim.write_text("untouched")
        for pid in range(os.getpid() - 5, os.getpid() + 5):   # the names the old writer would have used
            (e.path / f".plan.json.tmp{pid}").symlink_to(victim)
        fill(e, "plan")
        shared = Entry(tmp_path / "team", "k", shared=True)
        shared.open()
        assert shared.write(*DOCS["plan"])
    finally:
        os.umask(old)
    assert victim.read_text() == "untouched"
    assert [stat.S_IMODE(p.stat().st_mode) for p in (e.root, e.path, e.file(PLAN))] == [0o700, 0o700, 0o600]
    assert [stat.S_IMODE(p.stat().st_mode) for p in (shared.root, shared.path, shared.file(PLAN))] == \
        [0o770, 0o770, 0o660]


def another_users(directory: Path, monkeypatch) -> None:
    """Make `directory` another user's (as root), or this process another user (otherwise)."""
    if os.geteuid() == 0:
        os.chown(directory, 65534, -1)
    else:
        uid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: uid + 1)


@pytest.mark.parametrize("setup, refused", [
    (another_users, "belongs to uid"),
    (lambda d, _: os.chmod(d, 0o770), "is writable by its group (mode 770)"),
    (lambda d, _: os.chmod(d, 0o777), "is writable by every user (mode 777)"),
])
@pytest.mark.parametrize("where", ["root", "entry"])
def test_an_unsafe_cache_is_refused_in_one_line(tmp_path: Path, setup, refused: str, where: str,
                                                monkeypatch) -> None:
    """A cache another user owns or can write would have this job apply their plans. A team's cache
    (--auto-parallel-shared-cache) may be another's or the group's, never everyone's."""
    e = Entry(tmp_path / "cache", "k")
    e.open()
    setup(e.root if where == "root" else e.path, monkeypatch)
    with pytest.raises(PipetteError) as error:
        Entry(tmp_path / "cache", "k").open()
    message = str(error.value)
    assert message.startswith("--auto-parallel-cache-dir ") and refused in message and "\n" not in message
    if "every user" in refused:
        with pytest.raises(PipetteError, match="writable by every user"):
            Entry(tmp_path / "cache", "k", shared=True).open()
    else:
        assert "--auto-parallel-shared-cache" in message
        Entry(tmp_path / "cache", "k", shared=True).open()


def test_a_second_job_waits_for_the_first_and_gives_up_past_its_bound(entry: Entry) -> None:
    """fcntl.flock per entry: while another holder (another open file, as another job's would be) has
    it, this one waits, and waiting past the bound is one error naming the entry."""
    held, release = threading.Event(), threading.Event()

    def first_job() -> None:
        with Entry(entry.root, entry.key).locked(1.0):
            held.set()
            release.wait(10)

    first = threading.Thread(target=first_job)
    first.start()
    assert held.wait(10)
    start = time.monotonic()
    with pytest.raises(PipetteError, match=r"^--auto-parallel-cache-dir .*: another job has held .*\.lock for 0 s"), \
            entry.locked(0.3):
        pass
    assert 0.3 <= time.monotonic() - start < 3
    threading.Timer(0.5, release.set).start()
    with entry.locked(10.0) as waited:
        assert 0.3 < waited < 5
    first.join()


def test_the_key_tells_gpus_apart_and_nothing_else_changes_it() -> None:
    """Two jobs on disjoint GPUs of one node get two entries; the same job again gets the same one."""
    ranks = [{"host": "n0", "device": "NVIDIA H100", "gpu": f"GPU-{i}"} for i in range(4)]
    other = [{"host": "n0", "device": "NVIDIA H100", "gpu": f"GPU-{i}"} for i in range(4, 8)]
    key = cache_key(ranks, TINY, {"sequence_parallel": False})
    assert key == cache_key([dict(r) for r in ranks], TINY, {"sequence_parallel": False})
    assert key != cache_key(other, TINY, {"sequence_parallel": False})
    assert key != cache_key(ranks, TINY, {"sequence_parallel": False, "tensor_model_parallel_size": 2})


def start(entry: Entry, request: JobRequest = REQUEST, **switches) -> replan.Start:
    return replan.look_up(entry, request, replan.Switches(**switches), Phases())


@pytest.mark.parametrize("kind", DOCS)
def test_a_start_redoes_only_what_a_bad_file_held(entry: Entry, kind: str, capsys) -> None:
    """With every file cached and one bad: a bad plan is planned again from the cached probe; a bad
    probe, profile or calibration leaves the plan in use (and a bad calibration, calibrated since the
    plan, means the plan as it is). Without a plan, a bad probe or profile is measured again alone,
    and a bad calibration plans uncalibrated."""
    fill(entry, *DOCS)
    doc, _ = DOCS[kind]
    entry.file(doc).write_bytes(b"\x00garbage")
    found = start(entry)
    out = capsys.readouterr().out
    assert found.plan is not None
    if kind == "plan":
        assert "planning from the probe and layer profile cached in" in out and entry.read(PLAN) is not None
    else:
        assert f"using the plan in {entry.file(PLAN)}" in out
    assert out.count("WARNING") == (kind != "cluster" and kind != "profile")   # those are not read: not needed
    for k in ("cluster", "profile", "calibration"):
        entry.file(DOCS[k][0]).unlink(missing_ok=True)
    fill(entry, "cluster", "profile", "calibration")
    entry.file(PLAN).unlink()
    entry.file(doc).write_bytes(b"\x00garbage")
    found = start(entry)
    out = capsys.readouterr().out
    if kind in ("cluster", "profile"):
        assert found.plan is None and (found.cluster is None) == (kind == "cluster")
        assert (found.profile is None) == (kind == "profile")
    else:
        assert found.plan is not None and entry.read(PLAN) is not None
        assert ("calibrated model:" in out) == (kind != "calibration")
        assert (found.plan.calibration is not None) == (kind != "calibration")


def test_a_plan_that_cannot_be_saved_is_still_used(entry: Entry, monkeypatch, capsys) -> None:
    fill(entry, "cluster", "profile")
    monkeypatch.setattr(files, "_write_all", failing_write(errno.ENOSPC))
    found = start(entry)
    assert found.plan is not None and not entry.file(PLAN).exists()
    assert "WARNING: --auto-parallel-cache-dir" in capsys.readouterr().out


def test_a_cached_plan_for_another_job_warns_and_plans_again(entry: Entry, capsys) -> None:
    """A plan in the entry that this job's flags cannot run (here: another global batch, as a pinned or
    hand-copied plan would be) is a warning naming the difference, and the job plans again."""
    fill(entry, "cluster", "profile")
    other = workload_from_preset("tiny-gpt", global_batch_size=48)
    entry.write(PLAN, plan_doc(other, Layout(data_parallel_size=4, micro_batch_size=3)))
    found = start(entry)
    out = capsys.readouterr().out
    assert out.count("WARNING") == 1
    assert "cannot run this job (--global-batch-size 48 in the plan, 16 here): planning again" in out
    assert found.plan is not None and found.plan.model.global_batch_size == 16


def test_a_pinned_plan_is_checked_and_planned_again_when_it_cannot_run(entry: Entry, tmp_path: Path,
                                                                       capsys) -> None:
    fill(entry, "cluster", "profile")
    pinned = tmp_path / "pinned.json"
    pinned.write_text(json.dumps(plan_doc(TINY, Layout(data_parallel_size=4, micro_batch_size=2))))
    found = start(entry, plan_file=pinned)
    assert found.pinned and found.plan.to_json() == json.loads(pinned.read_text())
    assert "WARNING" not in capsys.readouterr().out
    pinned.write_text(json.dumps(plan_doc(TINY, Layout(data_parallel_size=4, micro_batch_size=3))))
    found = start(entry, plan_file=pinned)
    out = capsys.readouterr().out
    assert not found.pinned and found.plan.best.layout.micro_batch_size != 3
    assert f"WARNING: the plan in {pinned} cannot run this job (Megatron would reject its layout: " \
           "--global-batch-size 16 is not divisible by" in out
    assert out.count("WARNING") == 1 and "planning again" in out
    pinned.write_bytes(b"\xff")
    with pytest.raises(PipetteError, match=r"^--auto-parallel-plan-file .*: not a JSON file \(not UTF-8"):
        start(entry, plan_file=pinned)


@pytest.mark.parametrize("contents, why", [
    (b"{", "not valid JSON (Expecting property name enclosed in double quotes at line 1)"),
    (b"\xff", "not a JSON file (not UTF-8 text)"), (None, "no such file")], ids=["not JSON", "not UTF-8", "absent"])
def test_the_pinned_plan_and_the_cache_say_what_the_cli_says_of_a_file_that_is_not_json(
        entry: Entry, contents: bytes | None, why: str, tmp_path: Path, capsys) -> None:
    """(issue 32) Each reader once decoded JSON with its own texts ('cannot read: No such file or
    directory', 'not a JSON document (JSONDecodeError)'); all now say files.read_json's, as the CLI does."""
    pinned = tmp_path / "pinned.json"
    if contents is not None:
        pinned.write_bytes(contents)
        entry.file(PLAN).write_bytes(contents)
        assert entry.read(PLAN) is None
        assert f"WARNING: {entry.flag} {entry.file(PLAN)}: {why}; moved aside" in capsys.readouterr().out
    with pytest.raises(PipetteError) as error:
        start(entry, plan_file=pinned)
    assert str(error.value) == f"{replan.PINNED_FLAG} {pinned}: {why}"


@pytest.mark.parametrize("what", ["a FIFO", "/dev/null", "over the size bound"])
def test_a_pinned_plan_must_be_a_regular_file_of_a_bounded_size(entry: Entry, what: str, tmp_path: Path,
                                                                 monkeypatch) -> None:
    """(issue 33) A FIFO as --auto-parallel-plan-file hung rank 0 until the job died, and a link to
    /dev/zero read until memory ran out: anything but a regular file within files.MAX_DOCUMENT_BYTES
    is one error naming the flag (a link to a regular file is the user's own path: followed)."""
    pinned = tmp_path / "pinned.json"
    text = json.dumps(plan_doc(TINY, Layout(data_parallel_size=4, micro_batch_size=2)))
    if what == "a FIFO":
        os.mkfifo(pinned)
    elif what == "/dev/null":
        pinned.symlink_to(os.devnull)
    else:
        pinned.write_text(text)
        monkeypatch.setattr(files, "MAX_DOCUMENT_BYTES", len(text) - 1)
    error, hung = read_unhung(lambda: start(entry, plan_file=pinned), pinned if what == "a FIFO" else None)
    assert not hung and isinstance(error, PipetteError)
    why = "bytes, over the" if what == "over the size bound" else \
        f"not a regular file (a {'FIFO' if what == 'a FIFO' else 'character device'})"
    assert str(error).startswith(f"--auto-parallel-plan-file {pinned}: ") and why in str(error), error


@pytest.mark.parametrize("job, whys", [
    ({"nodes": ("elsewhere",)}, {"cluster": "it measured the hosts node0, not this job's elsewhere"}),
    ({"workload": workload_from_preset("tiny-gpt", hidden_size=128)},
     {"profile": "profiled for another model: hidden_size=64 (model has 128)"}),
    ({"device_name": "NVIDIA H100 80GB HBM3"}, {"cluster": "it measured cpu devices, this job's are NVIDIA H100",
                                                "profile": "it timed cpu, this job's devices are NVIDIA H100"}),
], ids=["hosts", "model", "device"])
def test_a_cached_measurement_of_another_job_is_set_aside(entry: Entry, job: dict, whys: dict, capsys) -> None:
    """(issue 33) A cluster.json of another allocation (copied between entries, or from a team's cache)
    or a profile of another model or device was used; the CLI refuses the same profile. Each is moved
    aside with one line, and measured again."""
    fill(entry, "cluster", "profile")
    request = JobRequest(**{"workload": TINY, "world_size": 4, "gpus_per_node": 4, "typed": REQUEST.typed,
                            "nodes": ("node0",), "device_name": "cpu", **job})
    found = start(entry, request)
    out = capsys.readouterr().out
    assert found.plan is None and out.count("WARNING") == len(whys), out
    for kind in ("cluster", "profile"):
        doc = DOCS[kind][0]
        assert (getattr(found, kind) is None) == (kind in whys)
        assert len(set_aside(entry, doc)) == (kind in whys)
        if kind in whys:
            assert f"{entry.file(doc)} is not of this job: {whys[kind]}" in out, out


def test_replan_and_reprobe_switches(entry: Entry, capsys) -> None:
    fill(entry, "cluster", "profile", "calibration")
    entry.write(PLAN, plan_doc(TINY, Layout(data_parallel_size=4, micro_batch_size=2)))
    found = start(entry, replan=True)
    out = capsys.readouterr().out
    assert "planning again (--auto-parallel-replan)" in out and "planning from the probe" in out
    assert found.plan.best.layout.micro_batch_size == 4
    found = start(entry, reprobe=True)
    assert found == replan.Start() and "planning again (--auto-parallel-reprobe)" in capsys.readouterr().out


def test_measurements_replace_the_calibration_fitted_to_the_old_ones(entry: Entry) -> None:
    fill(entry, "cluster", "profile", "calibration")
    from megatron_pipette.spec.layer_profile import profile_from_json

    replan.plan_measured(REQUEST, entry, Phases(), cpu_like(), profile_from_json(PROFILE_DOC),
                         {PROFILE: PROFILE_DOC})
    assert entry.read(CALIBRATION) is None and entry.read(PLAN) is not None


def test_a_restart_from_a_checkpoint_reuses_the_plan_it_saved_under(entry: Entry, capsys) -> None:
    """The checkpoint's choice of optimizer is not in the key: a restart finds the plan it was saved under
    and uses it; a plan the checkpoint cannot load is planned again with its choice."""
    fill(entry, "cluster", "profile")
    first = start(entry).plan
    saved = first.best.layout.use_distributed_optimizer
    capsys.readouterr()
    again = start(entry, JobRequest(workload=TINY, world_size=4, gpus_per_node=4, typed=REQUEST.typed,
                                    checkpoint=ResumeRule(saved=first.best.layout,
                                                          use_distributed_optimizer=saved))).plan
    assert again.to_json() == json.loads(json.dumps(first.to_json())) and "using the plan in" in capsys.readouterr().out
    other = start(entry, JobRequest(workload=TINY, world_size=4, gpus_per_node=4, typed=REQUEST.typed,
                                    checkpoint=ResumeRule(saved=first.best.layout,
                                                          use_distributed_optimizer=not saved))).plan
    out = capsys.readouterr().out
    assert f"--use-distributed-optimizer is {saved} in the plan, {not saved} fixed here by the checkpoint" in out
    assert other.best.layout.use_distributed_optimizer is (not saved)


def test_phase_lines_say_what_a_start_did() -> None:
    phases = Phases()
    for name in ("probe", "profile", "plan"):
        phases.skip(name, "cached")
    assert phases.line().startswith("probe, profile and plan cached; total ")
    phases = Phases()
    phases.skip("probe", "cached")
    phases.run("profile", lambda: None)
    assert phases.line().startswith("probe cached, profile 0.0 s; total")
