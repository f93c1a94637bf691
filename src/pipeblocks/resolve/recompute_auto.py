"""`--recompute auto`: choose which (stage, microbatch) forwards to recompute so that
every rank fits its memory budget, preferring recomputation that costs no step time.

A rank needs its static memory at the step's peak plus its peak activation
(`memory_need`). The choice is greedy on the simulator: simulate; for each rank over the
budget, take the pairs of its stages that are live at its memory peak (forward done,
backward not started) and add them, those that can hide first: the longest wait of the
rank between the pair's forward and its backward (where `recompute_place` can run it
without lengthening the step; the Program without recomputation tells the waits), then
the idle time just before the backward, then the longest lived, until the activation
they give up covers the excess; simulate again, and repeat until every rank fits. It
simulates once per round (a few rounds), not once per pair.

Then the choice is made minimal: each chosen pair, the least hideable first, is dropped
again when every rank still fits without it (one simulation per pair). So a pair is only
recomputed where it lowers a peak that binds, on a rank where it binds
(tests/test_recompute_choice.py checks the result against an exhaustive search).
When even full recomputation does not fit, the error gives the smallest budget that does.
"""
from __future__ import annotations

from ..core.ir.actions import Action, Kind
from ..core.cost.costs import Costs
from ..core.ir.errors import ScheduleError
from ..core.lowering.recompute import all_pairs
from ..core.ir.schedule import Schedule
from .program import simulate_run
from ..core.simulator.timeline import Timeline

__all__ = ["choose_recompute", "fits_memory", "memory_need", "minimal_recompute"]


def minimal_recompute(schedule: Schedule, costs: Costs, budget: float, chosen) -> frozenset[tuple[int, int]]:
    """`chosen` (an order: the most hideable first) without the pairs every rank fits without,
    the least hideable (last) tried first: one simulation per pair."""
    chosen = list(chosen)
    kept = list(chosen)
    for pair in reversed(chosen):
        trial = [q for q in kept if q != pair]
        if all(need <= budget for need in memory_need(simulate_run(schedule, costs, recompute=trial))):
            kept = trial
    return frozenset(kept)


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


def _candidates(timeline: Timeline, rank: int, chosen: set, waits: list[tuple[float, float]]
                ) -> list[tuple[float, float, float, tuple[int, int]]]:
    """(longest wait in its window, idle before its backward, lifespan, pair) for the pairs
    live at the rank's peak, best first. `waits`: (start, length) of the rank's waits in the
    Program without recomputation."""
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
                    window = max((length for start, length in waits if forward_end[pair] <= start < event.start),
                                 default=0.0)
                    out.append((window, event.start - previous_end, event.start - forward_end[pair], pair))
                forward_end.pop(pair)  # later chunks of the same pair are not candidates again
        previous_end = event.end
    out.sort(reverse=True)
    return out


def _waits(timeline: Timeline) -> list[list[tuple[float, float]]]:
    """Per rank, (start, length) of every wait between two compute events."""
    out = []
    for events in timeline.events:
        mine, previous = [], None
        for event in events:
            if previous is not None and event.start - previous > 1e-12:
                mine.append((previous, event.start - previous))
            previous = event.end
        out.append(mine)
    return out


def choose_recompute(
    schedule: Schedule, costs: Costs, budget: float | None, *, rounds: int = 64, unit: float = 1.0,
    minimal: bool = True,
) -> frozenset[tuple[int, int]]:
    """The pairs to recompute for `schedule` under `costs` within `budget` per rank (the
    costs' memory units); none without a budget or when it already fits. `unit`: the
    costs' memory units per --gpu-memory unit (1e9 bytes under the analytic model), for
    the error message. minimal=False skips the last step (a search that scores many
    candidates: `elastic_plan`, which makes its choice minimal once, at the end)."""
    if budget is None:
        return frozenset()
    chosen: list[tuple[int, int]] = []  # in the order chosen: the most hideable first
    table = costs.for_schedule(schedule)
    waits: list | None = None
    for _ in range(rounds):
        timeline = simulate_run(schedule, costs, recompute=chosen)
        need = memory_need(timeline)
        over = [r for r in range(schedule.p) if need[r] > budget]
        if not over:
            return minimal_recompute(schedule, costs, budget, chosen) if minimal else frozenset(chosen)
        if waits is None:  # the Program without recomputation: its waits do not move
            waits = _waits(timeline)
        added = False
        for r in over:
            excess = need[r] - budget
            for *_score, pair in _candidates(timeline, r, set(chosen), waits[r]):
                if excess <= 0:
                    break
                chosen.append(pair)
                added = True
                excess -= table.recomputed_share(pair[0])
        if not added:
            break
    full = memory_need(simulate_run(schedule, costs, recompute=all_pairs(schedule)))
    if max(full) > budget:
        raise ScheduleError(
            f"--gpu-memory {budget / unit:.4g} is too small for {schedule.name!r}: even full recomputation needs "
            f"{max(full) / unit:.4g} per rank (static memory at the step's peak + activation): raise "
            f"--gpu-memory to at least {max(full) / unit:.4g}, add replicas with sharding (--dp, --sharding zero3) "
            "or use more pipeline ranks"
        )
    return frozenset(all_pairs(schedule))
