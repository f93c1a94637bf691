"""`--sharding auto`: choose a sharding policy per chunk with the simulator.

The choice, among assignments that fit the memory budget (static memory at the step's peak
plus peak activation on every rank, when a budget is given), minimises the simulated step time, then
the largest static memory on any rank: step times within `tolerance` (relative, default
0.1%) of each other count as equal, so a policy that saves memory at no real cost in time
wins. The search is a coordinate descent over the chunks:
start from the best single policy for all chunks, then, chunk by chunk, try each policy
with the others fixed and keep any strict improvement, until a sweep changes nothing (at
most `sweeps`). It simulates 4 + 3 x chunks x sweeps schedules at most, not 4^chunks.

The memory check counts static memory at the step's peak (full-size gradients before their
reduction, ZeRO-3 parameters gathered), so it does not credit sharding with savings that
exist only between steps. It adds the two peaks even where they fall at different times
(conservative).
"""
from __future__ import annotations

import dataclasses

from collections.abc import Callable, Sequence

from ..core.costs import Costs
from ..core.errors import ScheduleError
from ..core.schedule import Schedule
from ..core.sharding import ShardingPolicy
from ..core.simulate import simulate

__all__ = ["choose_sharding", "descend_policies"]

_POLICIES = tuple(ShardingPolicy)


def choose_sharding(
    schedule: Schedule, costs: Costs, *, memory_budget: float | None = None, sweeps: int = 2,
    tolerance: float = 1e-3,
) -> tuple[ShardingPolicy, ...]:
    """One policy per chunk (global stage) for `schedule` under `costs` (whose data-parallel
    side gives d and the link); `memory_budget`: per rank, in the costs' memory units."""
    stages = schedule.num_stages
    seen: dict[tuple[ShardingPolicy, ...], tuple] = {}

    def score(policies: tuple[ShardingPolicy, ...]) -> tuple:
        if policies not in seen:
            dp = dataclasses.replace(costs.data_parallel, sharding=policies)
            timeline = simulate(schedule, dataclasses.replace(costs, data_parallel=dp))
            need = max(s + a for s, a in zip(timeline.static_memory_peak, timeline.peak_activation))
            over = max(0.0, need - memory_budget) if memory_budget is not None else 0.0
            seen[policies] = (over, timeline.makespan, max(timeline.static_memory), need)
        return seen[policies]

    def better(a: tuple[ShardingPolicy, ...], b: tuple[ShardingPolicy, ...]) -> bool:
        (over_a, time_a, static_a, _), (over_b, time_b, static_b, _) = score(a), score(b)
        if over_a != over_b:
            return over_a < over_b
        if abs(time_a - time_b) > tolerance * min(time_a, time_b):
            return time_a < time_b
        return static_a < static_b

    best = descend_policies(better, (_POLICIES[0],) * stages, [range(s, s + 1) for s in range(stages)], sweeps)
    over, _, _, need = score(best)
    if over > 0:
        raise ScheduleError(
            f"--sharding auto: no assignment fits --gpu-memory; the least found needs {need:.4g} per rank "
            f"(static memory at the step's peak + peak activation) against a budget of {memory_budget:.4g}: raise --gpu-memory, add replicas "
            "(--dp) or choose a schedule with less activation memory"
        )
    return best


Policies = tuple[ShardingPolicy, ...]


def descend_policies(
    better: Callable[[Policies, Policies], bool], start: Policies, moves: Sequence[range], sweeps: int = 2,
) -> Policies:
    """Coordinate descent over per-chunk policies: the best of `start` and every uniform
    assignment, then, for each move (a set of chunks that change together) and each
    policy, keep any trial that is `better`, until a sweep changes nothing (at most
    `sweeps`)."""
    stages = len(start)
    best = start
    for policy in _POLICIES:
        if better((policy,) * stages, best):
            best = (policy,) * stages
    for _ in range(sweeps):
        changed = False
        for move in moves:
            for policy in _POLICIES:
                trial = tuple(policy if s in move else best[s] for s in range(stages))
                if trial != best and better(trial, best):
                    best, changed = trial, True
        if not changed:
            break
    return best
