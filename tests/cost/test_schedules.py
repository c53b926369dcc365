"""Pipeline schedules: closed forms against the event-driven simulator and known answers."""

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from megatron_pipette.cost import simulator
from megatron_pipette.cost.interleaved import interleaved_time
from megatron_pipette.cost.schedules import SCHEDULES, StageTimes, schedule_for, with_interleaving


def times(f, b, phi=None, beta=None) -> StageTimes:
    f, b = np.asarray(f, float), np.asarray(b, float)
    if f.ndim == 2:
        f, b = f[None], b[None]
    batch, p, _ = f.shape
    phi = np.zeros((batch, p)) if phi is None else np.asarray(phi, float).reshape(batch, p)
    beta = np.zeros((batch, p)) if beta is None else np.asarray(beta, float).reshape(batch, p)
    return StageTimes(forward_s=f, backward_s=b, fwd_comm_s=phi, bwd_comm_s=beta)


def uniform(p, v, f=1.0, b=2.0):
    return times(np.full((p, v), f / v), np.full((p, v), b / v))


@pytest.mark.parametrize("p,m", [(2, 1), (4, 2), (4, 4), (4, 6), (4, 7), (4, 20), (8, 8), (8, 30), (3, 100)])
def test_1f1b_uniform_stages_take_m_plus_p_minus_1_slots(p, m):
    # covers the lattice with all-warmup stages (m < p), the full lattice (p <= m < 2p-1) and the closed form
    expected = (m + p - 1) * 3.0
    assert SCHEDULES["1f1b"].time(uniform(p, 1), m).total_s[0] == pytest.approx(expected)
    assert SCHEDULES["1f1b"].simulate(uniform(p, 1), m).total_s[0] == pytest.approx(expected)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 3), (8, 16, 2), (8, 8, 3)])
def test_interleaved_uniform_stages_follow_narayanan(p, m, v):
    # megatron-core's interleaved 1F1B: bubble (p-1)(f+b)/v with f, b the per-rank totals
    expected = m * 3.0 + (p - 1) * 3.0 / v
    assert SCHEDULES["interleaved"].simulate(uniform(p, v), m).total_s[0] == pytest.approx(expected)
    assert SCHEDULES["interleaved"].time(uniform(p, v), m).total_s[0] == pytest.approx(expected)


def test_no_pipelining_is_every_microbatch_back_to_back():
    assert SCHEDULES["no-pipelining"].time(times([[0.5]], [[1.5]]), 7).total_s[0] == pytest.approx(14.0)


def test_registry_picks_megatrons_schedule():
    assert schedule_for(1, 1).name == "no-pipelining"
    assert schedule_for(4, 1).name == "1f1b"
    assert schedule_for(4, 2).name == "interleaved"
    assert set(SCHEDULES) >= {"no-pipelining", "1f1b", "interleaved"}
    assert all(s.name == name for name, s in SCHEDULES.items())


durations = st.floats(0.01, 10.0, allow_nan=False)
comm = st.floats(0.0, 5.0, allow_nan=False)


@st.composite
def pipelines(draw, interleaved=False, fewer_microbatches_than_stages=False):
    """1F1B: any m (the lattice, with all-warmup stages when m < p, and the closed form), or
    only m < p, which is also checked against an answer computed without the simulator."""
    p = draw(st.integers(2, 8 if not interleaved else 6))
    v = draw(st.integers(2, 4)) if interleaved else 1
    if interleaved:
        m = p * draw(st.integers(1, 4))
    else:
        m = draw(st.integers(1, p - 1) if fewer_microbatches_than_stages else st.integers(1, 4 * p))
    shape = (2, p, v)
    f = np.array(draw(st.lists(durations, min_size=2 * p * v, max_size=2 * p * v))).reshape(shape)
    b = np.array(draw(st.lists(durations, min_size=2 * p * v, max_size=2 * p * v))).reshape(shape)
    phi = np.array(draw(st.lists(comm, min_size=2 * p, max_size=2 * p))).reshape(2, p)
    beta = phi if draw(st.booleans()) else np.array(draw(st.lists(comm, min_size=2 * p, max_size=2 * p))).reshape(2, p)
    return times(f, b, phi, beta), m


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines(), st.lists(st.floats(1.0, 3.0), min_size=4, max_size=4))
def test_1f1b_closed_form_is_the_simulator_with_slower_exchanges(case, slowdown):
    """Links that are not full duplex: messages inside an exchange run slower than alone."""
    t, m = case
    t = StageTimes(forward_s=t.forward_s, backward_s=t.backward_s, fwd_comm_s=t.fwd_comm_s,
                   bwd_comm_s=t.bwd_comm_s, fwd_xchg_s=t.fwd_comm_s * np.array(slowdown[:2])[:, None],
                   bwd_xchg_s=t.bwd_comm_s * np.array(slowdown[2:])[:, None])
    closed, sim = SCHEDULES["1f1b"].time(t, m), SCHEDULES["1f1b"].simulate(t, m)
    np.testing.assert_allclose(closed.total_s, sim.total_s, rtol=1e-9)
    np.testing.assert_allclose(closed.finish_s, sim.finish_s, rtol=1e-9)


def rendezvous_times(program: tuple, t: StageTimes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(total, finish, p2p) of one replica from the program's definition, independently of
    simulator.simulate: every op's end is the latest of what it waits for, found by sweeping the
    ranks until nothing changes. A compute op ends its duration after the previous op; a post
    ends when it is made; a transfer ends its duration after both sides posted it (the two-way
    rate when both posted it with the reverse message); a wait ends with the transfers it names.
    p2p: each rank's blocking calls, each as long as its slowest message."""
    f, b = t.forward_s[0], t.backward_s[0]
    (fx, bx), alone = t.exchange_s, (t.fwd_comm_s[0], t.bwd_comm_s[0])
    posts = {}                                        # key -> [(rank, op index, paired)] of both sides
    for r, ops in enumerate(program):
        for i, op in enumerate(ops):
            if op[0] == simulator.POST:
                for key, _, paired in op[1]:
                    posts.setdefault(key, []).append((r, i, paired))

    def duration(key):
        src, dst, direction, _ = key
        both = all(paired for _, _, paired in posts[key])
        rate = (fx[0], bx[0]) if both else alone
        return rate[direction][src if direction == simulator.FORWARD else dst]

    end = [[None] * len(ops) for ops in program]
    changed = True
    while changed:
        changed = False
        for r, ops in enumerate(program):
            for i, op in enumerate(ops):
                start = end[r][i - 1] if i else 0.0
                if end[r][i] is not None or start is None:
                    continue
                if op[0] == simulator.COMPUTE:
                    end[r][i] = start + (f if op[1] == simulator.FORWARD else b)[r, op[2]]
                elif op[0] == simulator.POST:
                    end[r][i] = start
                else:
                    sides = [[end[q][j] for q, j, _ in posts[key]] for key in op[1]]
                    if any(None in s for s in sides):
                        continue
                    end[r][i] = max([start] + [max(s) + duration(key) for s, key in zip(sides, op[1])])
                changed = True
    assert all(None not in e for e in end), "the program deadlocks"
    finish = np.array([max(end[r][i] for i, op in enumerate(ops) if op[:2] == (simulator.COMPUTE, simulator.BACKWARD))
                       for r, ops in enumerate(program)])
    p2p = np.array([sum(max(duration(key) for key in op[1]) for op in ops if op[0] == simulator.WAIT)
                    for ops in program])
    return max(e[-1] for e in end), finish, p2p


@settings(max_examples=100, deadline=None)
@given(pipelines(fewer_microbatches_than_stages=True), st.lists(st.floats(1.0, 3.0), min_size=2, max_size=2))
def test_1f1b_with_fewer_microbatches_than_stages_is_the_programs_longest_path(case, slowdown):
    """m < p: the lattice equals the program's longest path computed without the simulator."""
    t, m = case
    t = StageTimes(forward_s=t.forward_s[:1], backward_s=t.backward_s[:1], fwd_comm_s=t.fwd_comm_s[:1],
                   bwd_comm_s=t.bwd_comm_s[:1], fwd_xchg_s=t.fwd_comm_s[:1] * slowdown[0],
                   bwd_xchg_s=t.bwd_comm_s[:1] * slowdown[1])
    total, finish, _ = rendezvous_times(simulator.program_1f1b(t.shape[1], m), t)
    got = SCHEDULES["1f1b"].time(t, m)
    assert got.total_s[0] == pytest.approx(total, rel=1e-12)
    np.testing.assert_allclose(got.finish_s[0], finish, rtol=1e-12)


@settings(max_examples=60, deadline=None)
@given(pipelines(fewer_microbatches_than_stages=True))
def test_1f1b_one_microbatch_goes_down_and_back(case):
    """m = 1, by hand: every forward and its message down, every backward and its message back;
    stage s finishes when the backward has come back through it."""
    t, _ = case
    f, b = t.forward_s[0, :, 0], t.backward_s[0, :, 0]
    phi, beta = t.fwd_comm_s[0, :-1], t.bwd_comm_s[0, :-1]
    got = SCHEDULES["1f1b"].time(t, 1)
    down = f.sum() + phi.sum()
    back = np.cumsum((b + np.append(beta, 0.0))[::-1])[::-1]     # stage s: b_s..b_p-1 and hops s..p-2
    np.testing.assert_allclose(got.finish_s[0], down + back, rtol=1e-12)
    assert got.total_s[0] == pytest.approx(down + back[0], rel=1e-12)


@settings(max_examples=80, deadline=None)
@given(pipelines() | pipelines(fewer_microbatches_than_stages=True), st.floats(1.0, 3.0))
def test_1f1b_p2p_time_counts_the_programs_blocking_calls(case, slowdown):
    """p2p_s (the breakdown's pp_comm_s) is a count of calls per message kind; the program's own
    calls, each as long as its slowest message (exchanges at the two-way rate), give the same."""
    t, m = case
    t = StageTimes(forward_s=t.forward_s[:1], backward_s=t.backward_s[:1], fwd_comm_s=t.fwd_comm_s[:1],
                   bwd_comm_s=t.bwd_comm_s[:1], fwd_xchg_s=t.fwd_comm_s[:1] * slowdown, bwd_xchg_s=None)
    _, _, p2p = rendezvous_times(simulator.program_1f1b(t.shape[1], m), t)
    got = SCHEDULES["1f1b"].time(t, m)
    np.testing.assert_allclose(got.p2p_s[0], p2p, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.busy_s[0] - got.p2p_s[0],
                               m * (t.forward_s[0, :, 0] + t.backward_s[0, :, 0]), rtol=1e-12)


def test_exchanges_cost_more_than_single_messages_on_half_duplex_links():
    p, m = 4, 8
    alone = times(np.ones((p, 1)), np.full((p, 1), 2.0), np.full(p, 0.5), np.full(p, 0.5))
    half = StageTimes(forward_s=alone.forward_s, backward_s=alone.backward_s, fwd_comm_s=alone.fwd_comm_s,
                      bwd_comm_s=alone.bwd_comm_s, fwd_xchg_s=2 * alone.fwd_comm_s, bwd_xchg_s=2 * alone.bwd_comm_s)
    # every steady step of the bottleneck stage has two exchanges, each 0.5 s longer
    slower = SCHEDULES["1f1b"].time(half, m).total_s[0] - SCHEDULES["1f1b"].time(alone, m).total_s[0]
    assert slower == pytest.approx(SCHEDULES["1f1b"].simulate(half, m).total_s[0]
                                   - SCHEDULES["1f1b"].simulate(alone, m).total_s[0])
    assert slower >= 2 * 0.5 * (m - p)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_1f1b_closed_form_is_the_simulator(case):
    """Exact: unequal stages, asymmetric per-hop p2p, the lattice (m < 2p-1, all-warmup stages
    when m < p) and the closed form (m >= 2p-1)."""
    t, m = case
    closed, sim = SCHEDULES["1f1b"].time(t, m), SCHEDULES["1f1b"].simulate(t, m)
    np.testing.assert_allclose(closed.total_s, sim.total_s, rtol=1e-9)
    np.testing.assert_allclose(closed.finish_s, sim.finish_s, rtol=1e-9)
    assert np.all(closed.busy_s <= closed.total_s[:, None] * (1 + 1e-12))   # bubble never negative
    np.testing.assert_allclose(closed.finish_s[:, 0], closed.total_s)        # stage 0 finishes last


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 6), st.integers(2, 4), st.integers(1, 6), st.floats(0.0, 0.5), st.floats(0.0, 0.1))
def test_interleaved_within_2pct_without_p2p_cost(p, v, groups, heavy_last, heavy_first):
    """Equal ranks, a heavier output-layer chunk, a slightly heavier embedding chunk (a memory-bound
    gather), free p2p."""
    t = uniform(p, v)
    t.forward_s[0, -1, -1] *= 1 + heavy_last
    t.backward_s[0, -1, -1] *= 1 + heavy_last
    t.forward_s[0, 0, 0] *= 1 + heavy_first
    m = p * groups
    closed, sim = SCHEDULES["interleaved"].time(t, m), SCHEDULES["interleaved"].simulate(t, m)
    assert closed.total_s[0] == pytest.approx(sim.total_s[0], rel=0.02)


@settings(max_examples=80, deadline=None, phases=[Phase.generate])
@given(pipelines(interleaved=True))
def test_interleaved_closed_form_within_2pct_of_simulator(case):
    t, m = case
    closed, sim = SCHEDULES["interleaved"].time(t, m), SCHEDULES["interleaved"].simulate(t, m)
    np.testing.assert_allclose(closed.total_s, sim.total_s, rtol=0.02)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines(interleaved=True))
def test_interleaved_is_the_simulator(case):
    """Exact where it says so: unequal ranks and chunks, asymmetric per-hop p2p, 1 to 4 groups."""
    t, m = case
    closed, sim = SCHEDULES["interleaved"].time(t, m), SCHEDULES["interleaved"].simulate(t, m)
    assert closed.exact
    np.testing.assert_allclose(closed.total_s, sim.total_s, rtol=1e-9)
    np.testing.assert_allclose(closed.finish_s, sim.finish_s, rtol=1e-9)


@pytest.mark.parametrize("p,v,groups,seed", [(4, 3, 24, 0), (3, 2, 40, 1), (6, 4, 12, 2), (2, 5, 30, 3)])
def test_interleaved_skips_periodic_groups_exactly(p, v, groups, seed):
    """Many groups: the periodic steady state is skipped; exact lanes are the simulator's answer,
    extrapolated lanes (if any) stay within 0.1% (docs/time-model.md)."""
    rng = np.random.default_rng(seed)
    f, b = rng.uniform(0.1, 2, (6, p, v)), rng.uniform(0.2, 4, (6, p, v))
    phi, beta = rng.uniform(0, 1, (6, p)), rng.uniform(0, 1, (6, p))
    t, m = times(f, b, phi, beta), p * groups
    total, finish, exact = interleaved_time(f, b, phi, beta, m)
    sim = SCHEDULES["interleaved"].simulate(t, m)
    np.testing.assert_allclose(total[exact], sim.total_s[exact], rtol=1e-9)
    np.testing.assert_allclose(finish[exact], sim.finish_s[exact], rtol=1e-9)
    np.testing.assert_allclose(total, sim.total_s, rtol=1e-3)
    assert SCHEDULES["interleaved"].time(t, m).exact == exact.all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 4), st.integers(2, 3), st.integers(5, 24), st.integers(0, 2**32 - 1))
def test_interleaved_long_runs_are_the_simulator(p, v, groups, seed):
    """Strategy-like times (0.01-10, p2p 0-5) over many groups: replicas of different cyclicity
    share one pass; every replica flagged exact is the simulator's answer."""
    rng = np.random.default_rng(seed)
    f, b = rng.uniform(0.01, 10, (4, p, v)), rng.uniform(0.01, 10, (4, p, v))
    phi, beta = rng.uniform(0, 5, (4, p)), rng.uniform(0, 5, (4, p))
    m = p * groups
    total, _, exact = interleaved_time(f, b, phi, beta, m)
    sim = SCHEDULES["interleaved"].simulate(times(f, b, phi, beta), m).total_s
    np.testing.assert_allclose(total[exact], sim[exact], rtol=1e-9)
    np.testing.assert_allclose(total, sim, rtol=0.02)


def test_interleaved_regression_two_group_period_lands_in_the_tail():
    """A batch whose replicas repeat every 1 and every 2 groups: the skip is a whole number of
    2-group periods and must land on a wave the structure has (it once did not)."""
    rng = np.random.default_rng(51)          # cyclicities (1, 1, 1, 2); 2 of the 3 skippable groups
    p, v, m = 4, 2, 32
    f, b = rng.uniform(0.01, 10, (4, p, v)), rng.uniform(0.01, 10, (4, p, v))
    phi, beta = rng.uniform(0, 5, (4, p)), rng.uniform(0, 5, (4, p))
    total, _, exact = interleaved_time(f, b, phi, beta, m)
    sim = SCHEDULES["interleaved"].simulate(times(f, b, phi, beta), m).total_s
    assert exact.all()
    np.testing.assert_allclose(total, sim, rtol=1e-9)


def test_interleaved_extrapolation_is_flagged():
    """With no room to become periodic (max_groups 0 forces the jump after one group), lanes that
    were not yet periodic are extrapolated and reported as such; periodic ones stay exact."""
    rng = np.random.default_rng(5)
    p, v, m = 4, 3, 4 * 30
    f, b = rng.uniform(0.1, 2, (8, p, v)), rng.uniform(0.2, 4, (8, p, v))
    phi, beta = rng.uniform(0, 1, (8, p)), rng.uniform(0, 1, (8, p))
    total, _, exact = interleaved_time(f, b, phi, beta, m, max_groups=1)
    sim = SCHEDULES["interleaved"].simulate(times(f, b, phi, beta), m).total_s
    np.testing.assert_allclose(total[exact], sim[exact], rtol=1e-9)
    assert not np.allclose(total[~exact], sim[~exact], rtol=1e-12, atol=0)


def test_interleaved_never_exchanges():
    """Megatron's overlapped interleaved schedule posts each direction separately, so slower
    two-way (exchange) rates never apply: the model ignores them, and so does the simulator."""
    rng = np.random.default_rng(4)
    p, v, m = 4, 3, 12
    f, b = rng.uniform(0.1, 2, (2, p, v)), rng.uniform(0.2, 4, (2, p, v))
    phi, beta = rng.uniform(0, 1, (2, p)), rng.uniform(0, 1, (2, p))
    t = StageTimes(forward_s=f, backward_s=b, fwd_comm_s=phi, bwd_comm_s=beta, fwd_xchg_s=3 * phi,
                   bwd_xchg_s=3 * beta)
    np.testing.assert_allclose(SCHEDULES["interleaved"].time(t, m).total_s,
                               SCHEDULES["interleaved"].simulate(t, m).total_s, rtol=1e-9)


def test_interleaved_error_stays_where_documented():
    """Realistic stages, 1 to 8 groups (measured: all 120 flagged exact, the simulator's answer to
    rounding)."""
    rng = np.random.default_rng(8)
    errors, exact = [], []
    for _ in range(120):
        p, v = int(rng.choice([2, 4, 8])), int(rng.integers(2, 5))
        m = p * int(rng.integers(1, 9))
        speed = rng.uniform(0.8, 1.2, (p, 1))
        f, b = np.ones((p, v)) * speed, 2 * np.ones((p, v)) * speed
        f[-1, -1] *= 1 + rng.uniform(0, 0.5)
        b[-1, -1] *= 1 + rng.uniform(0, 0.5)
        phi = rng.uniform(0, 0.3) * rng.choice([0.1, 1.0], p)
        t = times(f, b, phi, phi * rng.uniform(0.9, 1.1, p))
        sim = SCHEDULES["interleaved"].simulate(t, m).total_s[0]
        closed = SCHEDULES["interleaved"].time(t, m)
        exact.append(closed.exact)
        errors.append(abs(closed.total_s[0] - sim) / sim)
    assert max(errors) < 1e-9
    assert sum(exact) >= 115


def test_interleaved_closed_form_never_below_a_ranks_own_work():
    t = uniform(4, 2)
    t.backward_s[0, 2] *= 5
    closed = SCHEDULES["interleaved"].time(t, 8)
    assert np.all(closed.busy_s <= closed.total_s[:, None])


def test_simulator_detects_deadlock():
    counters: dict = {}
    a, b = simulator._Builder(0, 2, counters), simulator._Builder(1, 2, counters)
    a.call(recv_next=True)    # rank 0 waits for a gradient that rank 1 sends only after...
    a.call(send_next=True)
    b.call(recv_prev=True)    # ...rank 1 received an activation that rank 0 sends only after that
    b.call(send_prev=True)
    program = simulator._finish([a, b])
    with pytest.raises(AssertionError, match="deadlock"):
        simulator.simulate(program, np.ones((2, 1)), np.ones((2, 1)), np.zeros(2), np.zeros(2))


def test_simulator_rejects_unmatched_messages():
    counters: dict = {}
    a, b = simulator._Builder(0, 2, counters), simulator._Builder(1, 2, counters)
    a.call(send_next=True)
    with pytest.raises(AssertionError, match="unmatched"):
        simulator._finish([a, b])


def test_simulator_rendezvous_blocks_the_sender():
    """A blocking send cannot start before the receiver posts: rank 0 waits for rank 1's compute."""
    counters: dict = {}
    a, b = simulator._Builder(0, 2, counters), simulator._Builder(1, 2, counters)
    a.call(send_next=True)
    a.compute(simulator.FORWARD, 0, 0)
    b.compute(simulator.FORWARD, 0, 0)
    b.call(recv_prev=True)
    result = simulator.simulate(simulator._finish([a, b]), np.array([[1.0], [5.0]]), np.ones((2, 1)),
                                np.array([0.5, 0.0]), np.zeros(2))
    assert result.end_s[0] == pytest.approx(5.0 + 0.5 + 1.0)
    assert result.end_s[1] == pytest.approx(5.5)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (3, 6, 3)])
def test_interleaved_program_matches_megatron_without_p2p_overlap(p, m, v):
    """--no-overlap-p2p-communication (blocking combined calls) gives the same uniform answer."""
    program = simulator.program_interleaved(p, m, v, overlap_p2p_comm=False)
    t = uniform(p, v)
    result = simulator.simulate(program, t.forward_s[0], t.backward_s[0], np.zeros(p), np.zeros(p))
    assert result.total_s == pytest.approx(m * 3.0 + (p - 1) * 3.0 / v)


@pytest.mark.parametrize("program", [simulator.program_1f1b(5, 3), simulator.program_interleaved(3, 6, 2)])
def test_simulating_replicas_at_once_equals_one_by_one(program):
    rng = np.random.default_rng(1)
    p, v = len(program), 2 if len(program) == 3 else 1
    f, b = rng.uniform(0.1, 2, (4, p, v)), rng.uniform(0.1, 2, (4, p, v))
    phi, beta = rng.uniform(0, 1, (4, p)), rng.uniform(0, 1, (4, p))
    together = simulator.simulate(program, f, b, phi, beta)
    for i in range(4):
        alone = simulator.simulate(program, f[i], b[i], phi[i], beta[i])
        assert together.total_s[i] == alone.total_s
        np.testing.assert_array_equal(together.finish_s[i], alone.finish_s)


def test_warmup_and_chunk_order_are_megatrons():
    """The one implementation the simulator and cost.memory share (get_pp_rank_microbatches,
    get_schedule_table with microbatch_group_size_per_vp_stage = PP)."""
    assert [simulator.interleaved_warmup(4, r, 8, 1, 4) for r in range(4)] == [3, 2, 1, 0]
    assert [simulator.interleaved_warmup(4, r, 2, 1, 4) for r in range(4)] == [2, 2, 1, 0]
    assert [simulator.interleaved_warmup(4, r, 8, 2, 4) for r in range(4)] == [10, 8, 6, 4]
    assert simulator.interleaved_warmup(4, 0, 4, 2, 4) == 8                 # capped at m*v: all warmup
    assert simulator.forward_chunks(4, 2, 2) == [0, 0, 1, 1, 0, 0, 1, 1]
    assert simulator.forward_chunks(6, 2, 4) == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1]


def test_interleaved_grad_sync_starts_rank_steps_after_each_chunks_last_backward():
    """Megatron launches chunk c's reduction pipeline_parallel_rank backward steps after that chunk's
    last backward: c*p - r steps before rank r's end (chunk 0's at the end), one after another.
    p 4, v 2, backward 1 s per chunk step, 10 s of reduction (5 a chunk): rank r's chunk 1 starts
    4 - r s before its end and chunk 0 follows it, so 6, 7, 8, 9 s remain exposed (the old model:
    chunk 1 hidden behind p steps on every rank, 6 s each)."""
    np.testing.assert_allclose(with_interleaving.grad_sync_exposed(np.full(4, 10.0), np.ones((4, 2))), [6, 7, 8, 9])
    # v 3, 5 s a chunk: chunk 2 starts 8 - r s before the end, chunk 1 (4 - r) waits for it, chunk 0 last.
    np.testing.assert_allclose(with_interleaving.grad_sync_exposed(np.full(4, 15.0), np.ones((4, 3))),
                               [7, 8, 9, 10])
    assert np.all(with_interleaving.grad_sync_exposed(np.full(4, 1.0), np.ones((4, 3))) == pytest.approx(1 / 3))
