"""`--sharding auto`: choose a sharding policy per chunk with the simulator.

The choice, among assignments that fit the memory budget (static memory at the step's peak
plus peak activation on every rank, when a budget is given), minimises the simulated step time, then
the chunks that regather (`zero3-regather`), then the largest static memory on any rank:
step times within `tolerance` (relative, default 0.1%) of each other count as equal, so a
policy that saves memory at no real cost in time wins, but a chunk gathers again between
its visits only when that fits a budget nothing else fits or saves time (its extra
gathers are link traffic, which the simulator counts as free once hidden, and memory below
the budget is worth nothing here). The search is a coordinate descent over the chunks:
start from the best single policy for all chunks, then, chunk by chunk, try each policy
with the others fixed and keep any strict improvement, until a sweep changes nothing (at
most `sweeps`). It simulates 4 + 3 x chunks x sweeps schedules at most, not 4^chunks.

The memory check counts static memory at the step's peak (full-size gradients before their
reduction, ZeRO-3 parameters gathered), so it does not credit sharding with savings that
exist only between steps. It adds the two peaks even where they fall at different times
(conservative), except on a rank with a `zero3-regather` chunk, where the simulator traces
that chunk's gathered parameters and the activations together (`Timeline.memory_need`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from ..core.cost.costs import Costs
from ..core.ir.errors import ScheduleError
from ..core.lowering.passes_dp import regather_stages
from ..core.ir.schedule import Schedule
from ..core.ir.sharding import ShardingPolicy
from .program import simulate_run

__all__ = ["choose_sharding", "descend_policies", "regathering"]

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
            timeline = simulate_run(schedule, costs.with_sharding(policies))
            need = max(timeline.memory_need)
            over = max(0.0, need - memory_budget) if memory_budget is not None else 0.0
            seen[policies] = (over, timeline.makespan, max(timeline.static_memory), need)
        return seen[policies]

    def better(a: tuple[ShardingPolicy, ...], b: tuple[ShardingPolicy, ...]) -> bool:
        (over_a, time_a, static_a, _), (over_b, time_b, static_b, _) = score(a), score(b)
        if over_a != over_b:
            return over_a < over_b
        if abs(time_a - time_b) > tolerance * min(time_a, time_b):
            return time_a < time_b
        if regathering(a) != regathering(b):
            return regathering(a) < regathering(b)
        return static_a < static_b

    best = descend_policies(better, (_POLICIES[0],) * stages, [range(s, s + 1) for s in range(stages)], sweeps,
                            regather=regather_stages(schedule))
    over, _, _, need = score(best)
    if over > 0:
        raise ScheduleError(
            f"--sharding auto: no assignment fits --gpu-memory; the least found needs {need:.4g} per rank "
            f"(static memory at the step's peak + peak activation) against a budget of {memory_budget:.4g}: raise --gpu-memory, add replicas "
            "(--dp) or choose a schedule with less activation memory"
        )
    return best


Policies = tuple[ShardingPolicy, ...]


def regathering(policies: Policies) -> int:
    """How many chunks free their parameters between visits (and so gather them again)."""
    return sum(1 for p in policies if ShardingPolicy(p).regathers)


def descend_policies(
    better: Callable[[Policies, Policies], bool], start: Policies, moves: Sequence[range], sweeps: int = 2,
    *, regather: frozenset[int] | None = None,
) -> Policies:
    """Coordinate descent over per-chunk policies: the best of `start` and every uniform
    assignment, then, for each move (a set of chunks that change together) and each
    policy, keep any trial that is `better`, until a sweep changes nothing (at most
    `sweeps`). `regather`: the chunks zero3-regather may go to (None: all;
    `passes_dp.regather_stages`)."""
    stages = len(start)
    best = start

    def allowed(policy: ShardingPolicy, chunks) -> bool:
        return not policy.regathers or regather is None or all(s in regather for s in chunks)

    for policy in _POLICIES:
        if allowed(policy, range(stages)) and better((policy,) * stages, best):
            best = (policy,) * stages
    for _ in range(sweeps):
        changed = False
        for move in moves:
            for policy in _POLICIES:
                if not allowed(policy, move):
                    continue
                trial = tuple(policy if s in move else best[s] for s in range(stages))
                if trial != best and better(trial, best):
                    best, changed = trial, True
        if not changed:
            break
    return best
