"""Pipeline schedules: the registry of megatron-core's schedules, one Schedule object each.

A schedule's module holds all the cost model asks of it (cost.schedules.base.Schedule: its closed
form, simulator program, busy time, warmup, activations in flight, and the data-parallel reduction
and parameter all-gather it leaves exposed); timing and memory ask the object Megatron would run
(schedule_for) and never compare names, so a new schedule is its own module plus a line here. The
derivations are in docs/time-model.md; `cost.simulator` is the reference the tests hold them to.

- "no-pipelining" (no_pipelining): PP = 1.
- "1f1b" (without_interleaving): exact closed form and lattice programme.
- "interleaved" (with_interleaving): exact wave recurrence (`cost.interleaved`).
"""

from megatron_pipette.cost.schedules import no_pipelining, with_interleaving, without_interleaving
from megatron_pipette.cost.schedules.base import InFlight, PipelineTime, Schedule, StageTimes

__all__ = ["SCHEDULES", "InFlight", "PipelineTime", "Schedule", "StageTimes", "schedule_for"]

SCHEDULES: dict[str, Schedule] = {s.name: s for s in (no_pipelining.SCHEDULE, without_interleaving.SCHEDULE,
                                                       with_interleaving.SCHEDULE)}


def schedule_for(pp: int, virtual_stages: int) -> Schedule:
    """Megatron's choice: no pipelining at PP 1, interleaving with model chunks, else 1F1B."""
    if pp == 1:
        return no_pipelining.SCHEDULE
    return with_interleaving.SCHEDULE if virtual_stages > 1 else without_interleaving.SCHEDULE
