"""The in-job self-check: time the first iterations Megatron trains under the plan, hold them
against the plan's predictions (logged, recorded in the cached plan and drawn beside it), and
calibrate the model for the next start on this allocation.

`arm()` is called by the hook once it chose a plan. It wraps megatron.training.training's
`train_step`, which Megatron's `train()` calls by its module-global name every iteration, and
megatron.core.pipeline_parallel.schedules' `forward_step` and `backward_step`, which every
schedule calls the same way: the user's script is not touched. The first step is left alone
(compilation, lazy allocations); the next `iterations` are timed; then the originals go back.
In CPU rehearsal, which has no allocator to ask, the first step's forward passes count what they
save for backward (the most held at once: the activations) and the check counts the tensors
alive between steps (the model state), to set against the plan's memory terms.

Nothing added on the training path is a collective. Each rank times itself: the host clock
around `train_step` (on CUDA, Megatron's step ends by reading the model-parallel all-reduce of
`update_successful` with `.item()`, so the host waits for the device every step and the host
time is the device time); its forward and backward passes by the host clock on CPU and by CUDA
events on a GPU, read only at the check. At the check every rank posts one record to torchrun's
store and only torchrun's rank 0 (the process that planned and holds the cache) reads them,
waiting at most REPORT_WAIT_S: a rank that died holds no one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_pipette.calibration.check import (
    CheckResult,
    MemorySample,
    RankSample,
    TensorSample,
    compare,
    sample_from_json,
)
from megatron_pipette.calibration.fit import Fit
from megatron_pipette.errors import PipetteError
from megatron_pipette.integration.cache import PLAN, Entry
from megatron_pipette.integration.common import log
from megatron_pipette.integration.replan import calibrate
from megatron_pipette.profile.measure import LiveSavedBytes, live_tensor_bytes, storage_keys
from megatron_pipette.report.plan_document import CandidateRecord, PlanRecord

CHECK_CHART = "self_check.png"
"""The check's chart, beside plan.json in the cache entry."""
REPORT_WAIT_S = 30.0
"""Longest rank 0 waits for the others' records: they post theirs at the end of the same step."""
RECORD_LOCK_S = 5.0
"""Longest rank 0 waits, inside a training step, for another job to release the cache entry."""
SKIPPED = 1
"""Steps before the timed ones: the first compiles, allocates optimizer state and fills caches."""
MODEL_ARG, FORWARD_BACKWARD_ARG = 2, 6
"""Positions of model (the list of model chunks) and forward_backward_func in
train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
forward_backward_func, ...)."""


@dataclass(frozen=True, kw_only=True)
class CheckSetup:
    """What the hook hands over: where to report, and what was predicted."""

    store: dist.Store
    """torchrun's store, which outlives a broken process group."""
    prefix: str
    """Store key prefix of this attempt's records."""
    iterations: int
    """Steps to time after the first."""
    plan: PlanRecord
    """The plan in use (its best candidate is the chosen layout)."""
    record: Entry | None
    """The cache entry whose plan.json is that plan (None: pinned with --auto-parallel-plan-file)."""
    concludes: bool
    """Whether this process reads the records and writes the cache: torchrun's rank 0, which planned
    and wrote that cache (re-ranking may have made another process rank 0, on another node)."""
    on_gpu: bool


PASSES = "passes"
"""Forward and backward passes (schedules.forward_step and backward_step)."""
FORWARD_BACKWARD = "forward_backward"
"""The whole forward_backward_func: passes, pipeline exchanges and bubbles, gradient synchronisation."""


class _HostSpans:
    """Seconds per step in each category, by the host clock (exact on CPU)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._start: dict[str, float] = {}

    def start(self, category: str) -> None:
        self._start[category] = time.perf_counter()

    def stop(self, category: str) -> None:
        self._current[category] = self._current.get(category, 0.0) + time.perf_counter() - self._start[category]

    def end_step(self) -> None:
        self.steps.append(self._current)
        self._current = {}

    def seconds(self, category: str) -> list[float]:
        return [step.get(category, 0.0) for step in self.steps]


class _CudaSpans:
    """The same by CUDA events on the current stream: the host only queues work, so its clock would
    measure launches. Read once, at the check."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, torch.cuda.Event, torch.cuda.Event]]] = []
        self._current: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._start: dict[str, torch.cuda.Event] = {}

    def start(self, category: str) -> None:
        self._start[category] = torch.cuda.Event(enable_timing=True)
        self._start[category].record()

    def stop(self, category: str) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._current.append((category, self._start[category], end))

    def end_step(self) -> None:
        self.steps.append(self._current)
        self._current = []

    def seconds(self, category: str) -> list[float]:
        torch.cuda.synchronize()
        return [sum(a.elapsed_time(b) for c, a, b in step if c == category) / 1e3 for step in self.steps]


class _Window:
    """This process's measurements, from arming to the check."""

    def __init__(self, setup: CheckSetup, originals: dict[tuple[Any, str], Callable]) -> None:
        self.setup = setup
        self.originals = originals
        self.calls = 0
        self.in_step = False
        self.step_s: list[float] = []
        self.before_bytes: list[int] = []
        self.spans = _CudaSpans() if setup.on_gpu else _HostSpans()
        self.saved: LiveSavedBytes | None = None
        """Counting the first step's saved tensors (CPU rehearsal), while it runs."""
        self.activations: int | None = None
        """The most bytes that step's forwards held for backward at once."""

    def begin_step(self) -> None:
        if self.setup.on_gpu:
            if not self.step_s:
                torch.cuda.reset_peak_memory_stats()
            self.before_bytes.append(torch.cuda.memory_allocated())
        self.in_step = True

    def end_step(self, seconds: float) -> None:
        self.in_step = False
        self.step_s.append(seconds)
        self.spans.end_step()

    def sample(self, rank: int, stage: int) -> RankSample:
        memory = tensors = None
        if self.setup.on_gpu:
            free, total = torch.cuda.mem_get_info()
            memory = MemorySample(before_step=min(self.before_bytes), peak_allocated=torch.cuda.max_memory_allocated(),
                                  peak_reserved=torch.cuda.max_memory_reserved(),
                                  outside_allocator=max(0, total - free - torch.cuda.memory_reserved()))
        elif self.activations is not None:
            tensors = TensorSample(model_state=live_tensor_bytes(), activations=self.activations)
        return RankSample(rank=rank, stage=stage, iteration_s=statistics.median(self.step_s),
                          forward_backward_s=statistics.median(self.spans.seconds(FORWARD_BACKWARD)),
                          compute_s=statistics.median(self.spans.seconds(PASSES)), memory=memory, tensors=tensors)


def _timed(original: Callable, category: str) -> Callable:
    """`original`, timed under `category` while a checked step runs."""
    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        window = _active
        if window is None or not window.in_step:
            return original(*args, **kwargs)
        window.spans.start(category)
        try:
            return original(*args, **kwargs)
        finally:
            window.spans.stop(category)

    return timed


def _forward(original: Callable) -> Callable:
    """schedules.forward_step, timed, and counting what it saves while the first step is counted."""
    timed = _timed(original, PASSES)

    @functools.wraps(original)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        window = _active
        if window is None or window.saved is None:
            return timed(*args, **kwargs)
        with window.saved.hooks():
            return timed(*args, **kwargs)

    return forward_step


_active: _Window | None = None


def arm(setup: CheckSetup) -> None:
    """Wrap Megatron's step and passes for this process (every rank calls it)."""
    global _active
    from megatron.core.pipeline_parallel import schedules
    from megatron.training import training

    originals = {(training, "train_step"): training.train_step, (schedules, "forward_step"): schedules.forward_step,
                 (schedules, "backward_step"): schedules.backward_step}
    _active = _Window(setup, originals)
    training.train_step = _timed_step(training.train_step)
    schedules.forward_step = _forward(schedules.forward_step)
    schedules.backward_step = _timed(schedules.backward_step, PASSES)


def _disarm() -> _Window:
    global _active
    window, _active = _active, None
    for (module, name), original in window.originals.items():
        setattr(module, name, original)
    return window


def _timed_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        window = _active
        if window is None:  # a reference kept from before the check ended
            return original(*args, **kwargs)
        window.calls += 1
        if window.calls <= SKIPPED:
            _skip_if_too_short(kwargs.get("iteration"))
            if window.calls < SKIPPED or window.setup.on_gpu or _active is None:
                return original(*args, **kwargs)
            # Module.buffers by its class: Megatron's DDP wrapper names its gradient buffers `buffers`.
            model = args[MODEL_ARG] if len(args) > MODEL_ARG else kwargs["model"]
            window.saved = LiveSavedBytes(storage_keys(t for chunk in model for t in (
                *chunk.parameters(), *torch.nn.Module.buffers(chunk))))
            try:
                return original(*args, **kwargs)
            finally:
                window.activations, window.saved = window.saved.peak, None
        # Megatron passes its schedule as the 7th argument; time it too.
        if len(args) > FORWARD_BACKWARD_ARG:
            args = (*args[:FORWARD_BACKWARD_ARG], _timed(args[FORWARD_BACKWARD_ARG], FORWARD_BACKWARD),
                    *args[FORWARD_BACKWARD_ARG + 1:])
        else:
            kwargs["forward_backward_func"] = _timed(kwargs["forward_backward_func"], FORWARD_BACKWARD)
        window.begin_step()
        start = time.perf_counter()
        out = original(*args, **kwargs)
        window.end_step(time.perf_counter() - start)
        if window.calls == SKIPPED + window.setup.iterations:
            _report(_disarm())
        return out

    return train_step


def _skip_if_too_short(iteration: int | None) -> None:
    from megatron.training import get_args

    total, needed = get_args().train_iters, SKIPPED + _active.setup.iterations
    if total is not None and iteration is not None and total - iteration < needed:
        _disarm()
        log(f"self-check skipped: it needs {needed} iterations, {total - iteration} remain to train "
            "(--auto-parallel-check-iterations)", dist.get_rank())


def _report(window: _Window) -> None:
    """Post this rank's record; rank 0 then compares, logs, records and calibrates. Failures are
    logged, never raised: the check must not stop the training it checks."""
    from megatron.core import parallel_state

    setup, rank = window.setup, dist.get_rank()
    try:
        sample = window.sample(rank, parallel_state.get_pipeline_model_parallel_rank())
        setup.store.set(f"{setup.prefix}{rank}", json.dumps(sample.as_json()))
        if setup.concludes:
            _conclude(setup, dist.get_world_size())
    except Exception as e:  # noqa: BLE001 (reported, and training goes on)
        print(f"> auto-parallel: self-check failed on rank {rank}: {type(e).__name__}: {e}", flush=True)


def _conclude(setup: CheckSetup, world: int) -> None:
    keys = [f"{setup.prefix}{r}" for r in range(world)]
    with contextlib.suppress(RuntimeError):  # some rank did not report in time (DistStoreError): compare the others
        setup.store.wait(keys, timedelta(seconds=REPORT_WAIT_S))
    present = [k for k in keys if setup.store.check([k])]
    samples = [sample_from_json(json.loads(v)) for v in setup.store.multi_get(present)]
    missing = sorted(set(range(world)) - {s.rank for s in samples})
    candidate = setup.plan.best
    result = compare(candidate.iteration_time_s, candidate.memory.stages, samples,
                     (SKIPPED + 1, SKIPPED + setup.iterations), missing)
    for line in result.lines():
        log(line, 0)
    if setup.record is None:
        log("self-check not recorded: the plan is pinned by --auto-parallel-plan-file", 0)
        return
    entry = setup.record
    try:
        with entry.locked(RECORD_LOCK_S):
            _record(entry, candidate, result)
    except PipetteError as e:   # another job holds the entry
        log(f"self-check not recorded: {e}", 0)


def _record(entry: Entry, candidate: CandidateRecord, result: CheckResult) -> None:
    """Write the check into the cached plan, fit the model's factors to it and store them for the
    next start (under the entry's lock)."""
    cached = entry.read(PLAN)
    if cached is None or cached.best.digest() != candidate.digest():
        log(f"self-check not recorded: {entry.file(PLAN)} holds another plan now, or none", 0)
        return
    if not entry.write(PLAN, replace(cached, self_check=result).to_json()):
        return
    log(f"self-check written to {entry.file(PLAN)}", 0)
    _draw(entry, result, calibrate(entry, cached, result))


def _draw(entry: Entry, result: CheckResult, fitted: Fit | None) -> None:
    """The check's chart beside its JSON; best effort: a chart that cannot be drawn is one warning."""
    try:
        from megatron_pipette.report.check_chart import check_chart

        png, _ = check_chart(result, fitted)
    except Exception as e:  # noqa: BLE001 (a picture must not stop the training it describes)
        log(f"WARNING: self-check chart not drawn: {type(e).__name__}: {e}", 0)
        return
    if entry.write_file(CHECK_CHART, png):
        log(f"self-check chart written to {entry.path / CHECK_CHART}", 0)
