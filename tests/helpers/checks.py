"""Self-checks as a job would report them where a known cost model is the truth."""

from megatron_pipette.calibration.check import MemorySample, RankSample
from megatron_pipette.cost.model import CostModel
from megatron_pipette.plan.placement import Placement
from megatron_pipette.spec.job import Job


def samples_where(truth: CostModel, job: Job, placement: Placement, memory_excess: int | None = None) -> list:
    """One rank per stage at the truth's times; with `memory_excess`, GPU memory figures at the truth's
    prediction, stage 0 holding that many bytes more outside the allocator."""
    est = truth.time(job, placement.logical_to_physical)
    samples = []
    for stage, (times, memory) in enumerate(zip(est.stage_times, truth.memory(job).stages)):
        measured = None
        if memory_excess is not None:
            state = memory.weight_bytes + memory.gradient_bytes + memory.optimizer_bytes
            measured = MemorySample(before_step=state, peak_allocated=state + memory.activation_bytes,
                                    peak_reserved=memory.total_bytes - memory.overhead_bytes,
                                    outside_allocator=memory.overhead_bytes + memory_excess * (stage == 0))
        samples.append(RankSample(rank=stage, stage=stage, iteration_s=est.iteration_time_s,
                                  forward_backward_s=est.iteration_time_s - est.breakdown.optimizer_s,
                                  compute_s=(times.forward_s + times.backward_s) * job.num_microbatches,
                                  memory=measured))
    return samples
