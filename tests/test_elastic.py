"""The elastic schedule: group sequences between depth-first and breadth-first."""
from __future__ import annotations

import itertools

import pytest

from pipeblocks import schedules
from pipeblocks.core.cost.costs import Costs
from pipeblocks.core.cost.dp_model import DPCostModel, Link
from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.core.simulator.simulate import simulate
from pipeblocks.schedules.elastic import balanced, rule_groups, search_groups

elastic = schedules.get("elastic")


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 12, 3), (3, 9, 2), (4, 4, 2), (2, 6, 4)])
def test_groups_of_p_are_interleaved_1f1b(p, m, v):
    groups = ",".join([str(p)] * (m // p))
    built = elastic(p=p, m=m, v=v, forward_groups=groups, backward_groups=groups)
    assert built.ranks == schedules.get("interleaved-1f1b")(p=p, m=m, v=v).ranks


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 12, 3), (3, 9, 2), (2, 6, 4)])
def test_one_group_of_m_is_bfs(p, m, v):
    assert elastic(p=p, m=m, v=v, forward_groups=m).ranks == schedules.get("bfs")(p=p, m=m, v=v).ranks


def _compositions(m: int):
    for cuts in itertools.product((False, True), repeat=m - 1):
        groups, size = [], 1
        for cut in cuts:
            if cut:
                groups.append(size)
                size = 1
            else:
                size += 1
        yield tuple(groups + [size])


@pytest.mark.sweep
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_accepted_group_sequence_simulates(p):
    checked = 0
    for m in range(1, 8 if p > 1 else 5):  # p=1 accepts every composition: keep it small
        legal = [g for g in _compositions(m) if all(x >= min(p, m) for x in g[:-1])]
        for v in (1, 2, 3):
            for forward, backward in itertools.product(legal, legal):
                timeline = simulate(elastic(p=p, m=m, v=v, forward_groups=forward, backward_groups=backward))
                assert sum(len(e) for e in timeline.events) == 2 * p * v * m
                checked += 1
    assert checked > 50


def test_paper_example_and_options():
    built = elastic(p=4, m=12, forward_groups="8,4", backward_groups="6,6")
    assert built.option("forward_groups") == (8, 4) and built.option("backward_groups") == (6, 6)
    # group of 8 through chunk 0 before chunk 1 on rank 0
    assert [str(a) for a in built.ranks[0][:9]] == [f"0F{i}" for i in range(8)] + ["4F0"]


@pytest.mark.parametrize("forward,backward,message", [
    ("8,3", None, "sums to 11"),
    ("8,4", "6,5", "sums to 11"),
    ("8,0,4", None, "1 or more"),
    ("8,-2,6", None, "1 or more"),
    ("2,10", None, r"at least min\(p, m\)=4"),
    ("8,x", None, "whole numbers"),
])
def test_bad_groups(forward, backward, message):
    with pytest.raises(ScheduleError, match=message):
        elastic(p=4, m=12, forward_groups=forward, backward_groups=backward)


def test_rule_without_costs_is_depth_first():
    assert rule_groups(4, 12, 2, None) == (4, 0, 12)
    assert elastic(p=4, m=12).ranks == schedules.get("interleaved-1f1b")(p=4, m=12).ranks


def _comm_bound() -> Costs:
    # one unit of parameters per stage over a slow link: reductions take several microbatches' compute
    return Costs(t_comm=0.0, data_parallel=DPCostModel(dp=8, link=Link(0.2, 0.0)))


def test_rule_follows_communication_and_memory():
    costs = _comm_bound()
    g, g_comm, g_mem = rule_groups(4, 16, 2, costs)
    assert g_comm > 4 and g == min(max(4, g_comm), 16)
    # static memory is 16 per stage's parameters; a budget leaving room for ~5 microbatches caps G
    g, _, g_mem = rule_groups(4, 16, 2, costs, gpu_memory=16 + 5.5)
    assert g_mem == 5 and g == 5
    # below p the rule keeps p and leaves the rest to recomputation
    assert rule_groups(4, 16, 2, costs, gpu_memory=16 + 1)[0] == 4


def test_search_is_no_worse_than_the_rule():
    costs = _comm_bound()
    g, _, _ = rule_groups(4, 16, 2, costs)
    start = ((g,) + tuple(min(g, 16 - s) for s in range(g, 16, g)), balanced(16, -(-16 // g)))
    chosen = search_groups(4, 16, 2, costs, None, start)
    t_rule = simulate(elastic(p=4, m=16, forward_groups=start[0], backward_groups=start[1]), costs).makespan
    t_best = simulate(elastic(p=4, m=16, forward_groups=chosen[0], backward_groups=chosen[1]), costs).makespan
    assert t_best <= t_rule
    automatic = elastic(p=4, m=16, costs=costs)
    assert simulate(automatic, costs).makespan == t_best


def test_balanced():
    assert balanced(12, 2) == (6, 6) and balanced(7, 3) == (3, 2, 2) and balanced(3, 5) == (1, 1, 1)
