"""Closed forms for the classic schedules (GPipe, 1F1B, interleaved 1F1B, BFPP), unit and general costs."""
import pytest

from pipeblocks import Costs, schedules, simulate

approx = pytest.approx


def run(name, costs=None, **kw):
    return simulate(schedules.get(name)(**kw), costs)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 16])
def test_gpipe_and_1f1b(p, m):
    for name in ("gpipe", "1f1b"):
        t = run(name, p=p, m=m)
        assert t.bubble_ratio == approx((p - 1) / (m + p - 1)), name
        assert t.makespan == approx(3 * (m + p - 1)), name
    assert list(run("gpipe", p=p, m=m).peak_activation) == [m] * p
    assert list(run("1f1b", p=p, m=m).peak_activation) == [min(m, p - r) for r in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_interleaved_closed_form(p, v, rounds):
    m = rounds * p
    t = run("interleaved-1f1b", p=p, m=m, v=v)
    assert t.bubble_ratio == approx((p - 1) / (v * m + p - 1))
    expected = [min(m * v, (v - 1) * p + 2 * (p - r - 1) + 1) / v for r in range(p)]
    assert list(t.peak_activation) == approx(expected)
    assert t.peak_activation[0] == approx(min(m, p + (p - 1) / v))


@pytest.mark.parametrize("p, m", [(2, 3), (3, 5), (4, 6), (4, 9), (5, 7), (4, 2), (8, 3)])
def test_interleaved_valid_when_p_does_not_divide_m(p, m):
    t = run("interleaved-1f1b", p=p, m=m, v=2)
    assert sum(len(e) for e in t.events) == 2 * p * m * 2  # every F and BW ran


@pytest.mark.parametrize("p, m, group", [(2, 8, 4), (4, 8, 8), (3, 9, 9), (4, 12, 6)])
def test_interleaved_group_size_dial(p, m, group):
    depth_first = run("interleaved-1f1b", p=p, m=m, v=2)
    grouped = run("interleaved-1f1b", p=p, m=m, v=2, group_size=group)
    # larger groups hold more microbatches in flight: never less memory than depth-first
    assert grouped.peak_activation[0] >= depth_first.peak_activation[0]
    assert grouped.peak_activation[0] == approx(min(m * 2, group + 2 * (p - 1) + 1) / 2)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_bfs_closed_form(p, v, extra):
    m = p + extra
    t = run("bfs", p=p, m=m, v=v)
    assert t.bubble_ratio == approx((p - 1) / (v * m + p - 1))
    assert list(t.peak_activation) == approx([m] * p)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (5, 3)])
def test_general_costs(p, m):
    costs = Costs(t_f=3, t_b=4, t_w=2)
    t = run("1f1b", costs, p=p, m=m)
    assert t.makespan == approx((m + p - 1) * 9)  # bubble (p-1)(TF+TB+TW)
    assert t.makespan - max(t.busy(r) for r in range(p)) == approx((p - 1) * 9)


@pytest.mark.parametrize("p", [2, 3, 5])
def test_communication_latency_on_the_critical_path(p):
    c = 0.25
    t = run("gpipe", Costs(t_comm=c), p=p, m=1)
    assert t.makespan == approx(p * 1 + p * 2 + 2 * (p - 1) * c)


def test_bad_inputs():
    from pipeblocks import ScheduleError

    with pytest.raises(ScheduleError, match="p must be an integer >= 1, got 0"):
        schedules.get("1f1b")(p=0, m=4)
    with pytest.raises(ScheduleError, match="m must be an integer >= 1"):
        schedules.get("gpipe")(p=2, m=-1)
    with pytest.raises(ScheduleError, match="group_size must be an integer >= p=4"):
        schedules.get("interleaved-1f1b")(p=4, m=8, group_size=2)
    with pytest.raises(ScheduleError, match="does not take option"):
        schedules.get("1f1b")(p=2, m=2, v=2)
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'; choose one of: .*1f1b"):
        schedules.get("nope")
