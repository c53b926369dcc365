"""The simulator's trace (what the timeline picture draws): it changes no figure, and every rank's
events are its program's passes and its blocked p2p calls, back to back from 0 to its end."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_pipette.cost import simulator
from megatron_pipette.cost.model import CostModel
from megatron_pipette.cost.schedules import SCHEDULES, StageTimes
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset

durations = st.floats(0.01, 10.0, allow_nan=False)
comm = st.floats(0.0, 5.0, allow_nan=False)


@st.composite
def pipelines(draw):
    """A schedule with the times of one replica: 1F1B with any micro-batch count, or interleaved."""
    name = draw(st.sampled_from(["1f1b", "interleaved"]))
    p = draw(st.integers(2, 6))
    v = draw(st.integers(2, 3)) if name == "interleaved" else 1
    m = p * draw(st.integers(1, 3)) if name == "interleaved" else draw(st.integers(1, 3 * p))
    f = np.array(draw(st.lists(durations, min_size=p * v, max_size=p * v))).reshape(1, p, v)
    b = np.array(draw(st.lists(durations, min_size=p * v, max_size=p * v))).reshape(1, p, v)
    phi = np.array(draw(st.lists(comm, min_size=p, max_size=p))).reshape(1, p)
    beta = np.array(draw(st.lists(comm, min_size=p, max_size=p))).reshape(1, p)
    return name, StageTimes(forward_s=f, backward_s=b, fwd_comm_s=phi, bwd_comm_s=beta), m


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_a_trace_changes_no_figure(case):
    name, times, m = case
    _, p, v = times.shape
    program = SCHEDULES[name].program(p, m, v)
    args = (times.forward_s[0], times.backward_s[0], times.fwd_comm_s[0], times.bwd_comm_s[0])
    plain, traced = simulator.simulate(program, *args), simulator.simulate(program, *args, trace=True)
    assert traced.total_s == plain.total_s
    assert np.array_equal(traced.finish_s, plain.finish_s) and np.array_equal(traced.end_s, plain.end_s)
    assert plain.events == () and traced.events


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_every_rank_runs_its_passes_and_waits_back_to_back(case):
    name, times, m = case
    _, p, v = times.shape
    result = SCHEDULES[name].trace(times, m)
    for r in range(p):
        mine = [e for e in result.events if e.rank == r]
        assert mine[0].start_s == 0 and mine[-1].end_s == result.end_s[r]
        assert all(a.end_s == b.start_s for a, b in zip(mine, mine[1:])), "a gap or an overlap"
        assert all(e.end_s > e.start_s for e in mine)
        for kind, seconds in (("forward", times.forward_s[0, r]), ("backward", times.backward_s[0, r])):
            passes = [e for e in mine if e.what == kind]
            assert sorted((e.chunk, e.microbatch) for e in passes) == [(c, i) for c in range(v) for i in range(m)]
            assert all(e.end_s - e.start_s == pytest.approx(seconds[e.chunk]) for e in passes)
        assert {e.what for e in mine} <= {"forward", "backward", "wait", "p2p"}


def test_free_links_expose_no_p2p_and_the_idle_time_is_the_bubble():
    p, m = 4, 8
    zero = np.zeros((1, p))
    times = StageTimes(forward_s=np.ones((1, p, 1)), backward_s=np.full((1, p, 1), 2.0), fwd_comm_s=zero,
                       bwd_comm_s=zero)
    result = SCHEDULES["1f1b"].trace(times, m)
    events = result.events
    assert not [e for e in events if e.what == "p2p"]
    # uniform stages: every rank idles (p - 1) slots of f + b in all, waiting or after its end
    for r in range(p):
        waits = sum(e.end_s - e.start_s for e in events if e.rank == r and e.what == "wait")
        assert waits + result.total_s - result.end_s[r] == pytest.approx((p - 1) * 3.0)
    first = [next(e for e in events if e.rank == r and e.what == "forward") for r in range(p)]
    assert [e.start_s for e in first] == [pytest.approx(r * 1.0) for r in range(p)]


def test_slow_links_show_as_exposed_p2p():
    p, m = 2, 4
    times = StageTimes(forward_s=np.ones((1, p, 1)), backward_s=np.ones((1, p, 1)),
                       fwd_comm_s=np.full((1, p), 0.5), bwd_comm_s=np.full((1, p), 0.5))
    events = SCHEDULES["1f1b"].trace(times, m).events
    # rank 1's first receive: rank 0 posts its send after its forward (t = 1), the message moves 0.5 s
    first = [e for e in events if e.rank == 1][:2]
    assert [(e.what, e.start_s, e.end_s) for e in first] == [("wait", 0.0, 1.0), ("p2p", 1.0, 1.5)]


def test_the_timeline_of_a_job_is_its_prediction():
    """CostModel.timeline carries time()'s estimate, and its simulated pass is the estimate's pipeline
    (the closed forms are exact), for each schedule; recomputation is in the backward passes."""
    cluster = preset_cluster("dgx-a100", num_nodes=2)
    workload = workload_from_preset("gpt3-1.3b", global_batch_size=64)
    model = CostModel(cluster)
    for fields in (dict(pipeline_model_parallel_size=4, recompute_granularity="full", recompute_method="uniform",
                        recompute_num_layers=1),
                   dict(pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=2),
                   dict(pipeline_model_parallel_size=1)):
        pp = fields["pipeline_model_parallel_size"]
        job = resolve_job(workload, Layout(tensor_model_parallel_size=2, data_parallel_size=8 // pp, micro_batch_size=4,
                                           **fields), cluster.world_size)
        timeline = model.timeline(job)
        estimate = model.time(job)
        assert timeline.estimate == estimate
        b = estimate.breakdown
        pipeline = (b.compute_s + b.recompute_s + b.tp_comm_s + b.cp_comm_s + b.ep_comm_s + b.pp_comm_s
                    + b.pipeline_bubble_s)
        assert timeline.pipeline_s == pytest.approx(pipeline, rel=1e-9)
        assert timeline.recompute_s.shape == (pp, job.virtual_stages)
        assert (timeline.recompute_s > 0).all() == ("recompute_granularity" in fields)
        backward = [e for e in timeline.events if e.what == "backward"]
        assert all(e.end_s - e.start_s > timeline.recompute_s[e.rank, e.chunk] for e in backward)
