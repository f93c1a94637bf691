"""`--recompute auto`: choose which (stage, microbatch) forwards to recompute so that
every rank fits its memory budget, preferring recomputation that costs no step time.

A rank needs its static memory at the step's peak plus its peak activation
(`memory_need`). The choice is greedy on the simulator: simulate; for each rank over the
budget, take the pairs of its stages that are live at its memory peak (forward done,
backward not started) and add them, most idle time just before their backward first
(a recomputation there fills a wait on a gradient or on communication), then the longest
lived, until the activation they give up covers the excess; simulate again, and repeat
until every rank fits. It simulates once per round (a few rounds), not once per pair.
When even full recomputation does not fit, the error gives the smallest budget that does.
"""
from __future__ import annotations

from ..core.actions import Action, Kind
from ..core.costs import Costs
from ..core.errors import ScheduleError
from ..core.recompute import all_pairs
from ..core.schedule import Schedule
from ..core.simulate import simulate
from ..core.timeline import Timeline

__all__ = ["choose_recompute", "fits_memory", "memory_need"]


def memory_need(timeline: Timeline) -> tuple[float, ...]:
    """Per rank: static memory at the step's peak plus peak activation; where a chunk frees
    its parameters between visits (zero3-regather), the two traced together over time
    (`Timeline.memory_need`)."""
    return timeline.memory_need


def fits_memory(timeline: Timeline, budget: float | None) -> bool | None:
    """Whether every rank's need is within `budget`; None without a budget."""
    if budget is None:
        return None
    return all(need <= budget * (1 + 1e-9) for need in memory_need(timeline))


def _candidates(timeline: Timeline, rank: int, chosen: set) -> list[tuple[float, float, tuple[int, int]]]:
    """(idle before its backward, lifespan, pair) for the pairs live at the rank's peak."""
    trace = timeline.memory[rank]
    peak_at = max(trace, key=lambda point: point[1])[0]
    forward_end: dict[tuple[int, int], float] = {}
    out = []
    previous_end = 0.0
    for event in timeline.events[rank]:
        action = event.action
        if type(action) is Action:
            pair = (action.stage, action.microbatch)
            if action.kind is Kind.F:
                forward_end.setdefault(pair, event.end)
            elif action.kind is not Kind.W and pair in forward_end and pair not in chosen:
                if forward_end[pair] <= peak_at < event.start:
                    out.append((event.start - previous_end, event.start - forward_end[pair], pair))
                forward_end.pop(pair)  # later chunks of the same pair are not candidates again
        previous_end = event.end
    out.sort(reverse=True)
    return out


def choose_recompute(
    schedule: Schedule, costs: Costs, budget: float | None, *, rounds: int = 64, unit: float = 1.0,
) -> frozenset[tuple[int, int]]:
    """The pairs to recompute for `schedule` under `costs` within `budget` per rank (the
    costs' memory units); none without a budget or when it already fits. `unit`: the
    costs' memory units per --gpu-memory unit (1e9 bytes under the analytic model), for
    the error message."""
    if budget is None:
        return frozenset()
    chosen: set[tuple[int, int]] = set()
    table = costs.for_schedule(schedule)
    for _ in range(rounds):
        timeline = simulate(schedule, costs, recompute=chosen)
        need = memory_need(timeline)
        over = [r for r in range(schedule.p) if need[r] > budget]
        if not over:
            return frozenset(chosen)
        added = False
        for r in over:
            excess = need[r] - budget
            for _idle, _life, pair in _candidates(timeline, r, chosen):
                if excess <= 0:
                    break
                chosen.add(pair)
                added = True
                excess -= table.recomputed_share(pair[0])
        if not added:
            break
    full = memory_need(simulate(schedule, costs, recompute=all_pairs(schedule)))
    if max(full) > budget:
        raise ScheduleError(
            f"--gpu-memory {budget / unit:.4g} is too small for {schedule.name!r}: even full recomputation needs "
            f"{max(full) / unit:.4g} per rank (static memory at the step's peak + activation): raise "
            f"--gpu-memory to at least {max(full) / unit:.4g}, add replicas with sharding (--dp, --sharding zero3) "
            "or use more pipeline ranks"
        )
    return frozenset(all_pairs(schedule))
