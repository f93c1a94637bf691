"""Costs given means cost-aware: zb-v, v-zb, v-half and v-min use non-unit costs by default."""
from __future__ import annotations

import pytest

from pipeblocks.core.cost.costs import Costs
from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.core.ir.placement import Placement
from pipeblocks.core.simulator.simulate import simulate
from pipeblocks.core.lowering.validate import validate
from pipeblocks.schedules import get
from pipeblocks.schedules._reorder import peaks_of
from pipeblocks.schedules._zb_search import refill_weights
from pipeblocks.schedules._zb_timing import Unplaceable

COSTS = Costs(t_f=3, t_b=4, t_w=2)
# The reference greedy generators' span bubble at 3:4:2, p=8, m=32 (the ZB paper's V
# greedy and the Controllable Memory paper's V-Half / V-Min pattern scheduler).
REFERENCE_SPAN_BUBBLE = {"zb-v": 0.043, "v-half": 0.123, "v-min": 0.326}


@pytest.fixture(scope="module")
def built():
    out = {}
    for name in ("zb-v", "v-half", "v-min"):
        for cost_aware in (None, False):
            out[name, cost_aware] = get(name)(p=8, m=32, costs=COSTS, cost_aware=cost_aware)
    return out


@pytest.mark.parametrize("name", sorted(REFERENCE_SPAN_BUBBLE))
def test_quality_at_3_4_2_no_worse_than_the_reference_greedy(built, name):
    ours = simulate(built[name, None], COSTS)
    fixed = simulate(built[name, False], COSTS)
    assert ours.bubble_ratio_span <= REFERENCE_SPAN_BUBBLE[name] + 5e-4
    assert ours.bubble_ratio_span <= fixed.bubble_ratio_span + 1e-12
    # the memory level is the fixed pattern's
    assert max(ours.peak_activation) <= max(fixed.peak_activation) + 1e-9


def test_zb_v_no_worse_than_its_reference_greedy_restated(built):
    ref = simulate(get("zb-v")(p=8, m=32, costs=COSTS, mode="reference"), COSTS)
    ours = simulate(built["zb-v", None], COSTS)
    assert ours.bubble_ratio_span <= ref.bubble_ratio_span + 1e-12


def test_v_half_beats_its_fixed_pattern_at_unequal_costs(built):
    fixed = simulate(built["v-half", False], COSTS).bubble_ratio_span
    ours = simulate(built["v-half", None], COSTS).bubble_ratio_span
    assert ours < fixed - 0.02


@pytest.mark.parametrize("name", ["zb-v", "v-zb", "v-half", "v-min"])
def test_default_follows_the_costs(name):
    p, m = 4, 8
    unit = get(name)(p=p, m=m)
    assert get(name)(p=p, m=m, costs=Costs()).ranks == unit.ranks  # unit costs: the fixed pattern
    assert dict(unit.options).get("cost_aware") is None
    aware = get(name)(p=p, m=m, costs=COSTS, search=10)
    assert dict(aware.options)["cost_aware"] is True
    validate(aware)
    fixed = get(name)(p=p, m=m, costs=COSTS, cost_aware=False)
    assert "cost_aware" not in dict(fixed.options)


def test_cost_aware_must_be_a_bool_or_none():
    with pytest.raises(ScheduleError, match="cost_aware must be True, False or None"):
        get("v-half")(p=4, m=8, costs=COSTS, cost_aware="yes")


def test_refill_weights_keeps_the_f_b_order_and_the_limit():
    p, m = 4, 8
    placement = Placement.v_shape(p)
    table = COSTS.resolve(placement)
    pattern = get("v-half")(p=p, m=m)
    limit = max(peaks_of(pattern.ranks, table))
    again = refill_weights(placement, pattern.ranks, table, limit)
    for old, new in zip(pattern.ranks, again):
        assert [a for a in old if a.kind.value != "W"] == [a for a in new if a.kind.value != "W"]
    assert max(peaks_of(again, table)) <= limit + 1e-9
    validate(type(pattern)("v-half", p, m, placement, again))
    with pytest.raises(Unplaceable):  # below the F/B order's own need nothing can be freed in time
        refill_weights(placement, pattern.ranks, table, limit / 2)


def test_long_builds_report_progress_through_logging(caplog):
    from pipeblocks.schedules._progress import Progress

    caplog.set_level("INFO", logger="pipeblocks.schedules")
    Progress("quick", after=3600).step("silent")
    Progress("slow", after=-1).step("halfway")
    messages = [r.getMessage() for r in caplog.records if r.name == "pipeblocks.schedules"]
    assert len(messages) == 1 and messages[0].startswith("slow: halfway (")


def test_uniform_costs_keep_the_pattern():
    scaled = Costs(t_f=0.5, t_b=0.5, t_w=0.5, mem_b=0.5)  # a sequence chunk's share of unit costs
    for name in ("zb-v", "v-half"):
        assert get(name)(p=4, m=8, costs=scaled).ranks == get(name)(p=4, m=8).ranks
    for costs in (Costs(t_comm=0.1), Costs(mem_w_ratio=0.5), Costs(1, 1, 0.5)):
        assert dict(get("v-half")(p=4, m=8, costs=costs, search=0).options)["cost_aware"] is True


@pytest.mark.parametrize("name", ["zb-v", "v-zb", "v-half", "v-min"])
def test_never_worse_than_the_pattern_with_unequal_stage_activations(name):
    p, m = 4, 8
    costs = Costs(t_f=3, t_b=4, t_w=2, mem_b=(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.5))  # a heavy last stage
    fixed = simulate(get(name)(p=p, m=m, costs=costs, cost_aware=False), costs)
    schedule = get(name)(p=p, m=m, costs=costs, search=20)
    ours = simulate(schedule, costs)
    assert ours.bubble_ratio_span <= fixed.bubble_ratio_span + 1e-12
    limit = dict(schedule.options)["memory_limit"]
    assert max(ours.peak_activation) <= limit + 1e-9
    # the pattern's own peak, or for zb-v 1F1B's (p times rank 0's 1 + 2.5), whichever is higher
    assert limit == max(max(fixed.peak_activation), p * 3.5 if name == "zb-v" else 0.0)
