"""The V family (v-min, v-half, v-zb, 1f1b-v, v-adaptive): validity, peaks, bubbles.

Unit memory model: F of one microbatch through a full stage holds 1, a V chunk 1/2;
1F1B's peak is p. Bubbles are counted in unit slots (one chunk pass at equal costs; the
simulator's scalar cost 1 is a full stage, so a chunk pass takes 1/2): span bubble is
the longest rank span (first pass start to last pass end) minus the busy time, as in
the papers; global bubble uses the whole makespan, as `Timeline.bubble_ratio` does.
"""
from __future__ import annotations

import pytest

from pipeblocks.core import ScheduleError, validate
from pipeblocks.schedules import get
from pipeblocks.sim import Costs, simulate

FIXED = ["v-min", "v-half", "v-zb", "1f1b-v"]

# Span bubble in unit slots of the reference generators for V-Min and V-Half
# (sail-sg/zero-bubble-pipeline-parallelism, scheduler/zbv_greedy.py) at equal costs,
# m = 2p+1, measured by running them.
REFERENCE_BUBBLE = {
    "v-min": {2: 3, 3: 5, 4: 11, 5: 15, 6: 17, 7: 23, 8: 27, 9: 29, 10: 35, 11: 39, 12: 41, 13: 47, 14: 51,
              15: 53, 16: 59},
    "v-half": {2: 1, 3: 5, 4: 5, 5: 11, 6: 11, 7: 17, 8: 17, 9: 23, 10: 23, 11: 29, 12: 29, 13: 35, 14: 35,
               15: 41, 16: 41},
}


def bubbles(tl) -> tuple[float, float]:
    """(span bubble, global bubble) in unit slots."""
    busy = max(tl.busy(r) for r in range(len(tl.events)))
    span = max(evs[-1].end - evs[0].start for evs in tl.events)
    return 2 * (span - busy), 2 * (tl.makespan - busy)


def lower_bound(p: int, peak: float) -> float:
    """CM's bound 6p - 1 - 3k slots with k = peak in chunk activations, clamped at 0."""
    return max(0.0, 6 * p - 1 - 3 * (2 * peak))


@pytest.mark.sweep
@pytest.mark.parametrize("name", FIXED)
def test_valid_for_every_p_and_m(name):
    for p in range(2, 17):
        for m in sorted({1, p - 1, p + 1, 2 * p + 1} - {0}):
            s = get(name)(p=p, m=m)
            assert (s.p, s.m, s.placement.shape) == (p, m, "v")
            validate(s)


@pytest.mark.parametrize("p", range(2, 17))
def test_peaks_and_bubbles(p):
    m = 2 * p + 1
    peak = {}
    for name in FIXED:
        tl = simulate(get(name)(p=p, m=m))
        peak[name] = max(tl.peak_activation)
        span, glob = bubbles(tl)
        assert span >= lower_bound(p, peak[name]) - 1e-9 or name == "1f1b-v", (name, span)
        if name in REFERENCE_BUBBLE:
            assert span <= REFERENCE_BUBBLE[name][p], (name, span)
        if name == "v-zb":
            assert span == 0  # zero bubble on every rank at equal costs
            assert glob == p - 1  # the last rank cannot start before the first F reaches it
    # the authors' closed forms: a third and a half of 1F1B's peak, rounded up per rank
    assert peak["v-min"] == (p + 4) // 3 <= p / 3 + (1 if p % 3 != 2 else 4 / 3)
    assert peak["v-half"] == (p + 2) // 2 <= p / 2 + 1
    assert peak["v-zb"] == p
    assert peak["1f1b-v"] <= (0.85 * p if p >= 4 else p)


@pytest.mark.parametrize(
    "name, p", [("v-half", 4), ("v-half", 8), ("v-half", 16), ("v-min", 4), ("v-min", 5), ("v-min", 8), ("v-min", 16)]
)
def test_v_half_and_v_min_meet_the_lower_bound(name, p):
    tl = simulate(get(name)(p=p, m=3 * p))
    assert bubbles(tl)[0] == lower_bound(p, max(tl.peak_activation))


def test_v_zb_with_unequal_costs_and_partial_weight_memory():
    p, m = 6, 13
    costs = Costs(t_f=1.0, t_b=1.3, t_w=0.7, t_comm=0.05, mem_w_ratio=0.6)
    s = get("v-zb")(p=p, m=m, costs=costs)
    validate(s)
    tl = simulate(s, costs)
    assert max(tl.peak_activation) <= p
    assert tl.bubble_ratio < simulate(get("1f1b")(p=p, m=m), costs).bubble_ratio


def test_m_below_p_and_a_single_microbatch():
    for name in FIXED:
        for m in (1, 3):
            tl = simulate(get(name)(p=8, m=m))
            assert len(tl.events[0]) == m * (4 if name == "1f1b-v" else 6)


@pytest.mark.sweep
def test_v_adaptive_curve_follows_the_bound():
    p, m = 6, 13
    previous = None
    for k in range(6, 2 * p + 1):  # chunk activations, from V-Min's level to 1F1B's
        limit = k / 2
        s = get("v-adaptive")(p=p, m=m, memory_limit=limit)
        validate(s)
        tl = simulate(s)
        span, glob = bubbles(tl)
        assert max(tl.peak_activation) <= limit
        target = lower_bound(p, limit)
        # at the bound for every even k; one slot above it at odd k, which is optimal there
        assert span == target + k % 2, (k, span, target)
        if previous is not None:
            assert glob <= previous  # more memory never costs time
        previous = glob


def test_v_adaptive_reports_the_smallest_feasible_limit():
    with pytest.raises(ScheduleError, match=r"smallest feasible limit is 3 ") as err:
        get("v-adaptive")(p=6, m=13, memory_limit=2.5)
    assert "memory_limit 2.5" in str(err.value)
    assert max(simulate(get("v-adaptive")(p=6, m=13, memory_limit=3)).peak_activation) == 3
    with pytest.raises(ScheduleError, match="must be > 0"):
        get("v-adaptive")(p=4, m=8, memory_limit=0)


def test_v_adaptive_weighs_costs():
    p, m = 4, 9
    costs = Costs(t_f=1.0, t_b=2.0, t_w=0.5, t_comm=0.1)
    s = get("v-adaptive")(p=p, m=m, memory_limit=3, costs=costs)
    validate(s)
    tl = simulate(s, costs)
    assert max(tl.peak_activation) <= 3
    # against V-Half's fixed block at the same memory (cost-aware v-half also searches
    # orders outside the blocks, ranked by span first; tested in test_cost_aware.py)
    fixed = get("v-half")(p=p, m=m, costs=costs, cost_aware=False)
    assert tl.makespan <= simulate(fixed, costs).makespan + 1e-9
    assert dict(s.options)["memory_limit"] == 3


@pytest.mark.parametrize("p", [2, 3, 5])
def test_v_adaptive_valid_for_small_and_uneven_m(p):
    for m in (2, 2 * p + 1):
        for limit in (None, p / 2 + 1):
            s = get("v-adaptive")(p=p, m=m, memory_limit=limit)
            validate(s)
            assert max(simulate(s).peak_activation) <= (p if limit is None else limit)


# At an odd number k of chunk activations the bound 6p-1-3k is not reachable: an exact
# integer program over all unit-cost orders of rank 0 (time-indexed, every dependency and
# the memory cap k, m = 2p to 3p) is infeasible at bubble 6p-1-3k for (p, k) = (2, 3),
# (3, 5) and (4, 7), while 6p-3k is reached (by v-adaptive, below). So 6p-3k is the target
# at odd k; v-adaptive meets it for p <= 12 (above, the looser-turn candidates would take
# a call past ~2 s and it stays at 6p-3k+1).
@pytest.mark.sweep
@pytest.mark.parametrize("p, k", [(3, 5), (4, 5), (4, 7), (8, 9), (8, 13), (8, 15)])
def test_v_adaptive_at_odd_k_is_one_slot_above_the_bound(p, k):
    s = get("v-adaptive")(p=p, m=3 * p, memory_limit=k / 2)
    validate(s)
    tl = simulate(s)
    assert max(tl.peak_activation) <= k / 2
    assert bubbles(tl)[0] == 6 * p - 3 * k
