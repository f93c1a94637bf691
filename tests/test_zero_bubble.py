"""Zero-bubble schedules: validity over p and m, closed forms, memory limits, cost-aware quality."""
from __future__ import annotations

import pytest

from pipeblocks.core import ScheduleError, validate
from pipeblocks.schedules import get
from pipeblocks.sim import Costs, simulate

PS = (2, 3, 4, 5, 8, 16)


def ms_for(p: int) -> tuple[int, ...]:
    return tuple(sorted({1, max(1, p - 1), p, p + 1, 2 * p - 1, 2 * p + 3, 3 * p}))


def span_bubble(timeline) -> float:
    """Idle time inside the worst rank's span (ZB paper's bubble): max span - max busy."""
    span = max(evs[-1].end - evs[0].start for evs in timeline.events)
    return span - max(timeline.busy(r) for r in range(len(timeline.events)))


def test_docstrings_show_real_p4_m8_schedules():
    for name in ("zb-h1", "zb-h2", "zb", "zb-1p", "zb-2p", "zb-v"):
        doc = get(name).doc
        for line in get(name)(p=4, m=8).to_text().splitlines()[1:]:
            assert line in doc, f"{name}: docstring lacks {line!r}"


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("p", PS)
def test_handcrafted_valid_for_all_m(name, p):
    for m in ms_for(p):
        schedule = get(name)(p=p, m=m)
        validate(schedule)
        assert schedule.has_split_backward


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("costs", [(1, 1, 1), (3, 4, 2), (2, 3, 1), (2, 3, 1.5)])
def test_zb_h1_closed_form(p, costs):
    t_f, t_b, t_w = costs
    for m in (p, p + 1, 2 * p + 3):
        timeline = simulate(get("zb-h1")(p=p, m=m), Costs(t_f=t_f, t_b=t_b, t_w=t_w))
        assert span_bubble(timeline) == pytest.approx((p - 1) * (t_f + t_b - t_w))
        assert timeline.makespan == pytest.approx(m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - t_w))
        one_f_one_b = simulate(get("1f1b")(p=p, m=m))
        assert max(timeline.peak_activation) == max(one_f_one_b.peak_activation) == p
        # stage s holds (p-s) M_B + s M_W; with M_W = M_B / 2 the peak falls from stage 0 outwards
        half = simulate(get("zb-h1")(p=p, m=m), Costs(mem_w_ratio=0.5))
        assert half.peak_activation == pytest.approx(tuple((p - s) + 0.5 * s for s in range(p)))


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("costs", [(1, 1, 1), (3, 4, 2), (2, 3, 1), (2, 2, 1)])
def test_zb_h2_closed_form(p, costs):
    t_f, t_b, t_w = costs
    for m in (2 * p - 1, 2 * p + 3, 3 * p):
        timeline = simulate(get("zb-h2")(p=p, m=m), Costs(t_f=t_f, t_b=t_b, t_w=t_w))
        assert span_bubble(timeline) == pytest.approx(max(0.0, (p - 1) * (t_f + t_b - 2 * t_w)))
        assert max(timeline.peak_activation) == 2 * p - 1
        half = simulate(get("zb-h2")(p=p, m=m), Costs(mem_w_ratio=0.5))
        assert half.peak_activation == pytest.approx(tuple((2 * p - 2 * s - 1) + 0.5 * 2 * s for s in range(p)))


def test_zb_h2_equal_costs_every_rank_busy_from_first_to_last_pass():
    timeline = simulate(get("zb-h2")(p=6, m=15))
    for rank, events in enumerate(timeline.events):
        for before, after in zip(events, events[1:]):
            assert after.start == pytest.approx(before.end), f"rank {rank} idles before {after.action}"


# ---- ZB-V --------------------------------------------------------------------------------

@pytest.mark.parametrize("p", PS)
def test_zb_v_valid_for_all_m_and_zero_bubble_at_1f1b_peak(p):
    for m in ms_for(p):
        schedule = get("zb-v")(p=p, m=m)
        validate(schedule)
        assert schedule.placement.shape == "v" and schedule.v == 2
        timeline = simulate(schedule)
        assert max(timeline.peak_activation) <= p  # 2p chunk activations of 1/2
        if m >= 2 * p - 1:
            assert span_bubble(timeline) == pytest.approx(0.0)
            assert timeline.peak_activation == pytest.approx((float(p),) * p)
            # rank 0 runs first and last: the global makespan is its busy time plus nothing
            assert timeline.events[0][0].start == 0.0 and timeline.busy(0) == pytest.approx(3 * m)


def test_zb_v_rejects_a_memory_limit_without_cost_aware():
    with pytest.raises(ScheduleError, match="cost_aware=True"):
        get("zb-v")(p=4, m=8, memory_limit=3)


# ---- greedy: zb, zb-1p, zb-2p, zb-v cost-aware ------------------------------------------------

UNEQUAL = (Costs(t_f=3, t_b=4, t_w=2), Costs(t_f=1, t_b=1, t_w=1, t_comm=0.1), Costs(t_f=2, t_b=3, t_w=1, mem_w_ratio=0.5))


@pytest.mark.sweep
@pytest.mark.parametrize("p", PS)
def test_greedy_valid_within_limit_for_all_m(p):
    for m in sorted({1, max(1, p - 1), p + 1, 2 * p + 3}):
        for name, kwargs, limit in (
            ("zb-1p", {}, p), ("zb-2p", {}, 2 * p), ("zb", {"memory_limit": 2}, 2),
            ("zb-v", {"cost_aware": True}, p), ("zb-v", {"cost_aware": True, "memory_limit": 1.5}, 1.5),
        ):
            costs = UNEQUAL[(p + m) % len(UNEQUAL)]
            schedule = get(name)(p=p, m=m, costs=costs, search=0, **kwargs)
            validate(schedule)
            timeline = simulate(schedule, costs)
            assert max(timeline.peak_activation) <= limit + 1e-9, (name, p, m)


@pytest.mark.parametrize("p", (2, 4, 6, 8))
def test_greedy_equal_costs_closed_forms(p):
    for m in (2 * p, 3 * p + 1):
        one_p = simulate(get("zb-1p")(p=p, m=m, search=0))
        assert span_bubble(one_p) <= (p - 1) + 1e-9  # ZB-H1's (p-1)(T_F+T_B-T_W)
        assert max(one_p.peak_activation) <= p
        two_p = simulate(get("zb-2p")(p=p, m=m, search=0))
        assert span_bubble(two_p) == pytest.approx(0.0)
        assert max(two_p.peak_activation) <= 2 * p
        v = simulate(get("zb-v")(p=p, m=m, cost_aware=True, search=0))
        assert span_bubble(v) == pytest.approx(0.0) and max(v.peak_activation) <= p


def _max_span(schedule, costs):
    return max(evs[-1].end - evs[0].start for evs in simulate(schedule, costs).events)


@pytest.mark.parametrize("p,m", [(3, 7), (4, 8), (4, 3), (5, 12), (8, 16)])
def test_best_mode_never_worse_than_reference_greedy(p, m):
    for costs in UNEQUAL + (Costs(),):
        for name, kwargs in (("zb-1p", {}), ("zb-2p", {}), ("zb-v", {"cost_aware": True})):
            ref = get(name)(p=p, m=m, costs=costs, mode="reference", **kwargs)
            best = get(name)(p=p, m=m, costs=costs, search=20, **kwargs)
            assert _max_span(best, costs) <= _max_span(ref, costs) + 1e-9, (name, p, m, costs)


def test_best_mode_beats_reference_where_it_cannot_fit_or_runs_long():
    costs = Costs(t_f=3, t_b=4, t_w=2)
    # at 1.5 units the reference V greedy cannot fit memory at all
    with pytest.raises(ScheduleError, match="cannot fit"):
        get("zb-v")(p=4, m=8, cost_aware=True, memory_limit=1.5, costs=costs, mode="reference")
    assert max(simulate(get("zb-v")(p=4, m=8, cost_aware=True, memory_limit=1.5, costs=costs), costs).peak_activation) <= 1.5
    # at 2 units the reference loop greedy runs much longer than our list scheduler
    ref = get("zb")(p=4, m=8, memory_limit=2, costs=costs, mode="reference")
    ours = get("zb")(p=4, m=8, memory_limit=2, costs=costs, search=0)
    assert _max_span(ours, costs) < 0.8 * _max_span(ref, costs)


def test_memory_limit_below_floor_states_the_smallest_feasible_limit():
    with pytest.raises(ScheduleError, match=r"smallest feasible limit is 1\b"):
        get("zb")(p=4, m=8, memory_limit=0.5)
    with pytest.raises(ScheduleError, match=r"smallest feasible limit is 1\b"):
        get("zb-v")(p=4, m=8, cost_aware=True, memory_limit=0.9)
    # exactly the floor works: one microbatch in flight per rank
    schedule = get("zb")(p=4, m=5, memory_limit=1, search=0)
    assert max(simulate(schedule).peak_activation) == 1
    assert max(simulate(get("zb-v")(p=4, m=5, cost_aware=True, memory_limit=1, search=0)).peak_activation) == 1


def test_bad_options_are_errors():
    with pytest.raises(ScheduleError, match="mode must be"):
        get("zb")(p=4, m=8, mode="fast")
    with pytest.raises(ScheduleError, match="search must be"):
        get("zb-2p")(p=4, m=8, search=-1)
    with pytest.raises(ScheduleError, match="does not take"):
        get("zb-1p")(p=4, m=8, memory_limit=3)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-v", "v-half", "zb"])
def test_greedy_timer_times_passes_as_the_simulator_does(name):
    """The cost-aware generators' Timer shares the simulator's timing and dependency rule:
    replaying a schedule's per-rank order through it gives every pass the simulated end.
    (The Timer places split B and W only, as the zero-bubble generators do.)"""
    from pipeblocks.schedules._zb_timing import Timer

    schedule = get(name)(p=4, m=8)
    costs = Costs(t_f=1.5, t_b=2.0, t_w=0.75, t_comm=0.25, mem_w_ratio=0.5)
    table = costs.resolve(schedule.placement)
    timer = Timer(schedule.placement, table, memory_limit=float("inf"))
    cursor = [0] * schedule.p
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in enumerate(schedule.ranks):
            while cursor[rank] < len(actions):
                a = actions[cursor[rank]]
                if timer.arrival(a.kind, a.stage, a.microbatch) is None:
                    break
                timer.put(a.kind, a.stage, a.microbatch)
                cursor[rank] += 1
                progressed = True
    assert cursor == [len(actions) for actions in schedule.ranks]
    timeline = simulate(schedule, costs)
    for events in timeline.events:
        for e in events:
            a = e.action
            assert timer.end[(a.kind, a.stage, a.microbatch)] == pytest.approx(e.end), a
