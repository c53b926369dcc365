"""PP 1: megatron-core's forward_backward_no_pipelining, one forward then one backward per
micro-batch: 1F1B's program on one rank, and 1F1B's data-parallel rules."""

from __future__ import annotations

import numpy as np

from megatron_pipette.cost import simulator
from megatron_pipette.cost.schedules.base import PipelineTime, Schedule, StageTimes
from megatron_pipette.cost.schedules.without_interleaving import (
    first_stage_grad_reduce,
    param_gather_at_first_forward,
    peak_in_flight,
)


def busy(times: StageTimes, m: int) -> tuple[np.ndarray, np.ndarray]:
    """All the rank's compute, no p2p."""
    work = m * (times.forward_s.sum(axis=2) + times.backward_s.sum(axis=2))
    return work, np.zeros_like(work)


def no_pipelining(times: StageTimes, m: int) -> PipelineTime:
    work, zero = busy(times, m)
    return PipelineTime(total_s=work[:, 0], finish_s=work, busy_s=work, p2p_s=zero, exact=True)


SCHEDULE = Schedule(name="no-pipelining", time=no_pipelining, busy=busy,
                    program=lambda p, m, v: simulator.program_1f1b(p, m), simulated=False,
                    warmup=lambda p, rank, m, v: 0, in_flight_states=peak_in_flight,
                    grad_reduce_exposed=first_stage_grad_reduce, param_gather_exposed=param_gather_at_first_forward)
