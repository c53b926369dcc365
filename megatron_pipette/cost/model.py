"""The cost model of one cluster: what a job takes in time and memory there.

Why one object: every estimate of a planning run shares the cluster, the layer profile and the
runtime overheads, and the search prices thousands of jobs that share work (a job's compute does
not depend on its placement) and links (layouts of one rank grid share them). The caches of what
depends on the cluster or the profile live here, for the life of the model, keyed by hashable jobs
and grids. The estimates themselves are the pure functions of cost.timing and cost.memory.

What stays at module level are memos of pure functions, whose answer depends on their arguments
alone, so no model sees another's state through them; each says so where it is:
- package data, read once: spec.hardware.gpu_catalog and cluster_presets, spec.megatron_flags.flag_table,
  cost.gemm._gemm_data and the curves built from it, cost.gemm.gemm_curve, fp8_curve and
  attention_curve (each curve remembers the efficiencies it looked up, GemmCurve._seen);
- schedule shapes, functions of a few integers: cost.simulator.program_1f1b and program_interleaved,
  cost.interleaved._structure, cost.memory._in_flight_states, _peak_candidates and _communicators;
- a layer's kernel launches, a function of the workload and three layout settings: cost.launch._layer_launches;
- cost.interleaved._MEMO: the interleaved schedule's times of the last stage times it was given
  (a planner prices layouts that differ only outside the pipeline).

    model = CostModel(cluster, profile=profile)
    job = resolve_job(workload, layout)
    model.time(job).iteration_time_s, model.memory(job).fits
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatron_pipette.cost.comm import AllToAll, GroupLinks, expert_dispatch, group_links
from megatron_pipette.cost.compute import StageWork, stage_work
from megatron_pipette.cost.execution import DEFAULT_EXECUTION, Execution
from megatron_pipette.cost.memory import DEFAULT_OVERHEADS, MemoryEstimate, RuntimeOverheads, estimate_memory
from megatron_pipette.cost.timing import TimeEstimate, Timeline, iteration_time, iteration_timeline
from megatron_pipette.spec.hardware import Cluster
from megatron_pipette.spec.job import Job
from megatron_pipette.spec.layer_profile import LayerProfile

MAX_CACHED_JOBS = 4096
"""Jobs whose work (and memory) is kept; the placement search re-prices the same few jobs many times."""


class CostModel:
    """Time and memory of jobs on `cluster`, measured layers from `profile` where it has them."""

    def __init__(self, cluster: Cluster, *, profile: LayerProfile | None = None,
                 overheads: RuntimeOverheads = DEFAULT_OVERHEADS, execution: Execution = DEFAULT_EXECUTION):
        self.cluster, self.profile, self.overheads, self.execution = cluster, profile, overheads, execution
        self._work: dict[Job, StageWork] = {}
        self._memory: dict[Job, MemoryEstimate] = {}
        self._default_links: dict[tuple, GroupLinks] = {}
        self._dispatch: dict[tuple[int, int, bool], AllToAll] = {}

    def work(self, job: Job) -> StageWork:
        """Compute of one micro-batch per stage and chunk (placement independent; shared by the
        jobs that differ only in their data-parallel options, which compute does not read)."""
        return _cached(self._work, _ignoring(job, use_distributed_optimizer=False, **OVERLAPS),
                       lambda: stage_work(job, self.cluster, self.profile))

    def links(self, job: Job, devices: np.ndarray | None = None) -> GroupLinks:
        """The links of the job's groups when logical rank r runs on device devices[r] (None:
        Megatron's default order, cached per rank grid)."""
        layout = job.layout
        grid = dict(cp=layout.cp, ep=layout.ep, etp=layout.etp, experts=job.workload.num_experts is not None,
                    flex=job.workload.moe_token_dispatcher_type == "flex")
        if devices is not None:
            return group_links(layout.tp, layout.pp, layout.dp, self.cluster, devices, **grid)
        key = (layout.tp, layout.pp, layout.dp, *grid.values())
        if key not in self._default_links:
            dispatch = None
            if grid["experts"]:      # the expert-parallel all-to-alls, shared by grids of one EP and ETP
                ep_etp = (layout.ep, layout.etp, grid["flex"])
                if ep_etp not in self._dispatch:
                    self._dispatch[ep_etp] = expert_dispatch(np.arange(self.cluster.world_size), *ep_etp[:2],
                                                             self.cluster, flex=grid["flex"])
                dispatch = self._dispatch[ep_etp]
            self._default_links[key] = group_links(layout.tp, layout.pp, layout.dp, self.cluster, **grid,
                                                   dispatch=dispatch)
        return self._default_links[key]

    def time_bound(self, job: Job, *, recompute: bool = True) -> float:
        """A lower bound on `time(job)` under any placement, without pricing a link, from compute on
        the cluster's fastest GPU. Every schedule runs a stage's passes one after another, and stage
        k's first pass (model chunk 0's forward of the first micro-batch) waits for chunk 0's forward
        on every stage before it, while its last (chunk 0's backward of the last micro-batch: a
        later chunk's backward always leads to one of chunk 0 on the same stage) has the same
        backwards still to run before it: so the iteration takes at least, for every k, stage k's own
        work plus stages 0..k-1's chunk-0 forward and backward of one micro-batch (the pipeline's
        fill and drain). The rest of the iteration only adds. `recompute` False leaves
        recomputation out: a bound for the job under any recomputation."""
        work = self.work(job)
        rate = float(self.cluster.step_gemm_flops.max())
        parts = (work.forward, work.backward) + ((work.recompute,) if recompute else ())
        per_chunk = sum(part.seconds(rate) for part in parts)                    # (p, v)
        fill_and_drain = np.concatenate(([0.0], np.cumsum(per_chunk[:-1, 0])))   # stages before k, chunk 0
        return float((job.num_microbatches * per_chunk.sum(axis=1) + fill_and_drain).max())

    def time(self, job: Job, devices: np.ndarray | None = None, *, simulate: bool = False) -> TimeEstimate:
        """Predicted iteration time under the placement `devices` (None: the default order)."""
        return iteration_time(job, self.cluster, self.work(job), self.links(job, devices), simulate=simulate,
                              execution=self.execution)

    def timeline(self, job: Job, devices: np.ndarray | None = None) -> Timeline:
        """`time(job, devices)` with the simulator's events of its critical replica (for pictures)."""
        return iteration_timeline(job, self.cluster, self.work(job), self.links(job, devices),
                                  execution=self.execution)

    def memory(self, job: Job) -> MemoryEstimate:
        """Peak memory of every pipeline stage against the cluster's per-device capacity (shared by
        the jobs that differ only in what they overlap)."""
        return _cached(self._memory, _ignoring(job, **OVERLAPS),
                       lambda: estimate_memory(job, self.cluster.memory_bytes, profile=self.profile,
                                               overheads=self.overheads,
                                               nvls_domain=self.cluster.gpus_per_domain if self.cluster.nvls else 0,
                                               fp8_any_layout=self.cluster.gpu is not None
                                               and self.cluster.gpu.fp8_gemm_any_layout))


OVERLAPS = dict(overlap_grad_reduce=False, overlap_param_gather=False, overlap_param_gather_with_optimizer_step=False,
                tp_comm_overlap=False)
"""What a layout overlaps: neither the compute nor the memory of a job reads it."""


def _ignoring(job: Job, **fields) -> Job:
    """The job with these layout fields reset: the cache key of an estimate that does not read them."""
    return dataclasses.replace(job, layout=dataclasses.replace(job.layout, **fields))


def _cached(cache: dict, key: Job, compute):
    """cache[key], computed once; the cache is emptied when it holds MAX_CACHED_JOBS."""
    hit = cache.get(key)
    if hit is None:
        if len(cache) >= MAX_CACHED_JOBS:
            cache.clear()
        hit = cache[key] = compute()
    return hit
