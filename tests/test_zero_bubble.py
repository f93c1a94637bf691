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
    for name in ("zb-h1", "zb-h2"):
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
