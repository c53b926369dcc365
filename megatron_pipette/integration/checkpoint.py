"""The checkpoint a job resumes from, and the plan each checkpoint was saved under.

Megatron's --load directory holds `latest_checkpointed_iteration.txt` (the tracker: an iteration, or
`release`) and one directory per checkpoint, `iter_NNNNNNN/`; --ckpt-step names another iteration.

* At save, `record_plan_at_save` has rank 0 write the plan into the directory of each iteration
  Megatron saves (`iter_NNNNNNN/pipette_plan.json`), once Megatron's save_checkpoint returns: the
  plan travels with its checkpoint, and a start that crashes before saving leaves none behind.
* At a resume, `find_resume` reads what the checkpoint fixes from the checkpoint itself: Megatron's
  arguments and content metadata in its common state (megatron-core's load_common_state_dict), so a
  checkpoint saved without --auto-parallel, or whose plan is damaged, binds the search as well
  (megatron_args.checkpoint_rule). The plan of the iteration loaded (else the top-level
  `pipette_plan.json` earlier versions wrote at start) says the layout it was saved under in full
  where it agrees with those arguments; a damaged one is moved aside with one line.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_pipette.errors import PipetteError, UnresumableCheckpoint
from megatron_pipette.files import read_bounded, read_json, write_atomic
from megatron_pipette.integration import megatron_args
from megatron_pipette.integration.cache import move_aside
from megatron_pipette.integration.common import log
from megatron_pipette.report.plan_document import PlanRecord
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.resume import ResumeRule

CHECKPOINT_PLAN = "pipette_plan.json"
"""The plan a checkpoint was saved under, in its iteration's directory (at the top of --save before)."""
CHECKPOINT_TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's marker of the latest checkpoint in a --load directory."""
MAX_PLAN_BYTES = 64 << 20
"""A plan document is a few kB; a larger file is no plan."""
SAME_GRID = ("tp", "pp", "cp", "ep", "etp", "dp", "use_distributed_optimizer")
"""What a checkpoint's plan must agree on with the checkpoint's own arguments to describe it."""


@dataclass(frozen=True)
class Resume:
    """The checkpoint this job resumes from."""

    where: str
    """"--load DIR (iteration N)"."""
    saved: Layout
    """The layout it was saved under: its plan's, or its own arguments'."""
    rule: ResumeRule
    """What a layout must keep to load it."""


def iteration_dir(args: Any) -> tuple[Path, bool] | None:
    """The directory of the checkpoint Megatron will load and whether it is a release checkpoint, as
    Megatron chooses it (training/checkpointing.py: read_metadata, --ckpt-step); None without one."""
    load = getattr(args, "load", None)
    if not load:
        return None
    tracker, step = Path(load) / CHECKPOINT_TRACKER, getattr(args, "ckpt_step", None)
    if not step and not tracker.is_file():
        return None
    try:    # a regular file of a few bytes (a FIFO here would hang the start)
        text = "" if step else read_bounded(tracker, "--load", limit=4096).decode(errors="replace").strip()
    except PipetteError as e:
        raise UnresumableCheckpoint(str(e)) from None
    if text == "release":
        return Path(load) / "release", True
    try:
        iteration = step or int(text)
    except ValueError:
        raise UnresumableCheckpoint(f"--load {load}: {CHECKPOINT_TRACKER} holds {text[:40]!r}, not an iteration "
                                    "(Megatron stops on it too)") from None
    return Path(load) / f"iter_{iteration:07d}", False


def find_resume(args: Any) -> Resume | None:
    """The checkpoint this job will resume from, or None (no --load, no checkpoint there). One that
    cannot be read, or is not torch_dist (a layout change cannot load the others), stops the job with
    one line (UnresumableCheckpoint): Megatron would fail on it on every rank."""
    found = iteration_dir(args)
    if found is None:
        return None
    path, release = found
    where = f"--load {args.load} ({'release' if release else path.name})"
    if not path.is_dir():
        raise UnresumableCheckpoint(f"{where}: {path} is missing; point --load (or --ckpt-step) at a checkpoint")
    saved_args, metadata = _common_state(path, where)
    rule = megatron_args.checkpoint_rule(saved_args, metadata, args, release=release)
    return Resume(where=where, saved=_described(path, Path(args.load), rule.saved, where), rule=rule)


def _common_state(path: Path, where: str) -> tuple[Any, dict | None]:
    """Megatron's arguments and content metadata from the checkpoint's common state."""
    if not (path / ".metadata").is_file():
        raise UnresumableCheckpoint(f"{where}: not a torch_dist checkpoint (Megatron reloads other formats only "
                                    "under the layout that saved them): resume it without --auto-parallel, or "
                                    "convert it with Megatron's --ckpt-convert-format torch_dist")
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    try:
        common = load_common_state_dict(str(path))
    except Exception as e:  # noqa: BLE001 (any failure to read it is one line: Megatron could not load it either)
        raise UnresumableCheckpoint(f"{where}: cannot read its common state ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    saved_args = common.get("args") if isinstance(common, dict) else None
    if saved_args is None or not hasattr(saved_args, "world_size"):
        raise UnresumableCheckpoint(f"{where}: its common state holds no Megatron arguments, so what it fixes of "
                                    "the layout is unknown: resume it without --auto-parallel")
    return saved_args, common.get("content_metadata")


def _described(path: Path, load: Path, own: Layout, where: str) -> Layout:
    """The layout to name as the one the checkpoint was saved under: its plan's (the iteration's, else
    the top-level one of earlier versions) where it agrees with the checkpoint's own arguments."""
    for plan_file in (path / CHECKPOINT_PLAN, load / CHECKPOINT_PLAN):
        planned = _read_plan(plan_file, where)
        if planned is None:
            continue
        if all(getattr(planned, k) == getattr(own, k) for k in SAME_GRID):
            return planned
        log(f"WARNING: {plan_file} names {planned.describe()}, not the layout of the checkpoint's own arguments "
            f"({own.describe()}): it is not this checkpoint's plan, and is left alone", 0)
    return own


def _read_plan(plan_file: Path, where: str) -> Layout | None:
    """The layout of a checkpoint's plan, or None: absent, or damaged (then moved aside, one line)."""
    try:
        doc = read_json(plan_file, "--load", limit=MAX_PLAN_BYTES, follow=False, missing_ok=True)
        return PlanRecord.from_json(doc, str(plan_file)).best.layout
    except FileNotFoundError:
        return None
    except PipetteError as e:       # not a regular file, too large, not JSON, or not a plan document
        why = str(e)
    except Exception as e:  # noqa: BLE001 (a reader tripping on a malformed field: only this file)
        why = f"{plan_file} is damaged ({type(e).__name__}: {str(e)[:80]})"
    move_aside(plan_file, f"{where}: {why}", "what the checkpoint fixes is read from the checkpoint itself")
    return None


def write_plan(save: str, iteration: int, plan: PlanRecord) -> None:
    """`plan` into the directory of checkpoint `iteration` under --save (PipetteError naming --save)."""
    directory = Path(save) / f"iter_{iteration:07d}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PipetteError(f"--save {save}: cannot create {directory.name}: {e.strerror or e}") from None
    write_atomic(directory / CHECKPOINT_PLAN, (json.dumps(plan.to_json(), indent=1) + "\n").encode(), "--save")


def record_plan_at_save(args: Any, plan: PlanRecord, is_writer: Callable[[], bool]) -> None:
    """Wrap Megatron's save_checkpoint (in megatron.training.checkpointing, and in training, which
    imported it by name) so that, once it returns, the process `is_writer` names writes `plan` into
    the iteration's directory (not for non-persistent checkpoints, which live elsewhere)."""
    from megatron.training import checkpointing, training

    original = getattr(checkpointing.save_checkpoint, "__wrapped__", checkpointing.save_checkpoint)

    @functools.wraps(original)
    def save_checkpoint(iteration, *rest, **kwargs):
        result = original(iteration, *rest, **kwargs)
        if not kwargs.get("non_persistent_ckpt") and is_writer():
            try:
                write_plan(args.save, iteration, plan)
            except PipetteError as e:
                log(f"WARNING: {e}; a restart from this checkpoint will describe it from its own arguments", 0)
        return result

    checkpointing.save_checkpoint = training.save_checkpoint = save_checkpoint


def resume_line(resume: Resume, now: Layout, load: str) -> str:
    """The hook's line on the resume: the layouts it was saved and is resumed under, and what Megatron does."""
    saved = resume.saved.describe()
    line = f"resuming the checkpoint in {load} (saved as {saved}) in "
    if now.describe() == saved:
        return line + "the same layout"
    if not resume.rule.binds:
        return line + f"{now.describe()} (Megatron reshards its weights; its optimizer state is not loaded)"
    return line + f"{now.describe()} (Megatron reshards it; kept as saved: {resume.rule.describe()})"


def restarts_note() -> str:
    """Under torchrun's elastic agent, what its restarts will do after the hook stops (every worker exit but
    success is a failure it restarts, up to --max-restarts: torch/distributed/elastic/agent/server/api.py)."""
    env = os.environ
    left = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return (f" (torchrun will restart the workers {left} more time(s), until --max-restarts is used up; a start on "
            "the same processes stops the same way, before probing or loading anything)") if left > 0 else ""
