"""The overhead breakdown: a measured Timeline's bubble excess over its model, split into
hand-over latency, pass overruns and time between passes (pure Python, no torch)."""
import dataclasses

import pytest

from pipeblocks import Costs, schedules, simulate
from pipeblocks.core.simulator.timeline import Event, Timeline
from pipeblocks.sim.overhead import (
    handover_gaps,
    local_gaps,
    measured_costs,
    overhead_breakdown,
)

approx = pytest.approx
MS = 1e-3


def in_seconds(timeline: Timeline, *, delay_after: float = 0.0) -> Timeline:
    """A simulated Timeline (ms) as a measured one (s); with delay_after, every rank's passes
    after its first are pushed back by that much more each (time lost between passes)."""
    events = tuple(
        tuple(Event(e.action, e.start * MS + i * delay_after, e.end * MS + i * delay_after) for i, e in enumerate(evs))
        for evs in timeline.events
    )
    return dataclasses.replace(timeline, events=events)


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_a_run_that_is_its_model_has_no_excess(name):
    schedule = schedules.get(name)(p=4, m=8)
    model = Costs(t_f=5.0, t_b=5.0, t_w=5.0)
    b = overhead_breakdown(in_seconds(simulate(schedule, model)), model, unit_s=MS)
    assert b.excess_pp == approx(0, abs=1e-9)
    assert b.latency_s == approx(0, abs=1e-12) and b.overrun_s == approx(0, abs=1e-12)
    assert b.local_gap_s == approx(0, abs=1e-12)


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "v-half"])
def test_latency_is_read_off_the_handovers_and_explains_the_excess(name):
    schedule = schedules.get(name)(p=4, m=8)
    model = Costs(t_f=5.0, t_b=5.0, t_w=5.0)
    measured = in_seconds(simulate(schedule, dataclasses.replace(model, t_comm=0.4)))
    b = overhead_breakdown(measured, model, unit_s=MS)
    assert b.handovers > 0
    assert b.latency_s == approx(0.4 * MS)
    assert b.excess_pp > 0.5, "0.4 ms per hop costs bubble at 5 ms per pass"
    assert b.latency_pp == approx(b.excess_pp)
    assert b.excess_over_latency_pp == approx(0, abs=1e-9)
    assert b.overrun_pp == approx(0, abs=1e-9) and b.between_pp == approx(0, abs=1e-9)
    assert all(g == approx(0.4 * MS) for g in handover_gaps(measured))


def test_longer_passes_are_overrun_and_gaps_are_between():
    schedule = schedules.get("zb-v")(p=4, m=8)
    model = Costs(t_f=5.0, t_b=5.0, t_w=5.0)
    slower = simulate(schedule, Costs(t_f=5.5, t_b=5.5, t_w=5.5))
    b = overhead_breakdown(in_seconds(slower), model, unit_s=MS)
    assert b.overrun_s == approx(0.25 * MS)  # a V rank holds two chunks: a pass is half its stage's cost
    assert b.between_pp == approx(0, abs=1e-9) and b.latency_pp == approx(0, abs=1e-9)
    assert b.overrun_pp == approx(b.excess_pp)

    gapped = in_seconds(simulate(schedule, model), delay_after=0.2 * MS)
    g = overhead_breakdown(gapped, model, unit_s=MS)
    assert g.local_gap_s > 0 and g.between_pp > 1.0, "0.2 ms more before each pass is bubble"
    assert g.excess_pp == approx(g.latency_pp + g.overrun_pp + g.between_pp)
    assert all(gap == approx(0.2 * MS) for gap in local_gaps(gapped))


def test_measured_costs_are_per_stage_means():
    schedule = schedules.get("1f1b")(p=2, m=4)  # fused backward: BW counts as B, W = 0
    timeline = in_seconds(simulate(schedule, Costs(t_f=(2.0, 4.0), t_b=(3.0, 5.0), t_w=(1.0, 1.0))))
    costs = measured_costs(timeline, unit_s=MS)
    assert costs.t_f == approx((2.0, 4.0)) and costs.t_b == approx((4.0, 6.0)) and costs.t_w == approx((0.0, 0.0))


def test_bad_arguments_are_named():
    schedule = schedules.get("1f1b")(p=2, m=2)
    timeline = in_seconds(simulate(schedule))
    with pytest.raises(ValueError, match="unit_s"):
        overhead_breakdown(timeline, Costs(), unit_s=0)
    with pytest.raises(ValueError, match="latency_s"):
        overhead_breakdown(timeline, Costs(), unit_s=MS, latency_s=float("nan"))
