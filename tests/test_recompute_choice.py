"""`--recompute auto` chooses few pairs, only where a peak binds, and the simulator places
them in idle time: against an exhaustive search of every subset of pairs on small cases the
choice is as small as the smallest that fits, every chosen pair is on a rank over the
budget without recomputation; a placed recomputation never makes a rank later or fuller
than its default place, and the timeline says which part of it lengthens the step."""
from __future__ import annotations

import itertools

import pytest

from pipeblocks import schedules
from pipeblocks.core.cost.costs import Costs
from pipeblocks.core.lowering.entry import lower_for
from pipeblocks.core.ir.ops import Recompute
from pipeblocks.core.lowering.recompute import all_pairs, check_recompute
from pipeblocks.core.simulator.simulate import simulate
from pipeblocks.resolve.recompute_auto import choose_recompute, memory_need
from pipeblocks.resolve.recompute_place import place_recompute

# budgets between full recomputation's need and none's (unit costs: static memory 16 per rank)
CASES = [("1f1b", dict(p=2, m=4), 17.34), ("1f1b", dict(p=3, m=3), 17.67), ("1f1b", dict(p=3, m=3), 18.24),
         ("interleaved-1f1b", dict(p=2, m=2), 17.0), ("interleaved-1f1b", dict(p=2, m=2), 17.43),
         ("gpipe", dict(p=2, m=4), 18.0), ("bfs", dict(p=2, m=3), 17.34)]


def _fits(schedule, costs, pairs, budget) -> bool:
    return max(memory_need(simulate(schedule, costs, recompute=pairs))) <= budget


@pytest.mark.parametrize("name, sizes, budget", CASES)
def test_the_choice_is_as_small_as_an_exhaustive_search_finds(name, sizes, budget):
    schedule, costs = schedules.get(name)(**sizes), Costs()
    chosen = choose_recompute(schedule, costs, budget)
    assert _fits(schedule, costs, chosen, budget)
    every = sorted(all_pairs(schedule))
    smallest = next(k for k in range(len(every) + 1)
                    if any(_fits(schedule, costs, subset, budget) for subset in itertools.combinations(every, k)))
    assert 0 < len(chosen) == smallest
    over = {r for r, need in enumerate(memory_need(simulate(schedule, costs))) if need > budget}
    assert {schedule.placement.rank_of(stage) for stage, _ in chosen} <= over
    for pair in chosen:  # minimal: none of them can go
        assert not _fits(schedule, costs, chosen - {pair}, budget), pair


def test_a_recomputation_moves_into_a_wait_and_stops_lengthening_the_step():
    # V-Half with slow transfers: each rank waits for the other's activations and gradients
    schedule = schedules.get("v-half")(p=2, m=4)
    costs = Costs(t_comm=1.0)
    pairs = all_pairs(schedule)
    default = simulate(schedule, costs, recompute=pairs)
    at = place_recompute(schedule, costs, pairs)
    placed = simulate(schedule, costs, recompute=pairs, recompute_at=at)
    assert len(at) == 7 and (default.recompute_step_cost, placed.recompute_step_cost) == (2.0, 1.5)
    for r in range(schedule.p):
        assert placed.rank_end(r) <= default.rank_end(r) + 1e-9
        assert placed.memory_need[r] <= default.memory_need[r] + 1e-9
        assert placed.recompute_time[r] == default.recompute_time[r]
        assert 0 <= placed.recompute_exposed[r] <= placed.recompute_time[r] + 1e-9
    program = lower_for(schedule, recompute=pairs, recompute_at=at)
    check_recompute(program)
    for unit, anchor in at.items():  # each runs before the action it was anchored to, after its own forward
        ops = program.ranks[schedule.placement.rank_of(unit[0])]
        where = next(i for i, op in enumerate(ops) if type(op) is Recompute and op.unit == unit)
        assert where < ops.index(anchor) and anchor.unit != unit  # earlier than its own backward


def test_no_recomputation_leaves_the_timeline_without_its_figures():
    timeline = simulate(schedules.get("1f1b")(p=2, m=4), Costs())
    assert timeline.recompute_exposed == () and timeline.recompute_step_cost is None
    assert "recompute_exposed" not in timeline.summary()
