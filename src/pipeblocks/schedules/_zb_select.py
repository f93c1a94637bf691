"""Choosing among cost-aware zero-bubble candidates: shared by `zb` and cost-aware `zb-v`.

mode "reference": the reference greedy's own pick over its knob grid (the baseline).
mode "best": the best by simulation of the reference candidates, the caller's extra
candidates (handcrafted orders), the memory-safe list scheduler preferring B or F, then
`search` steps of local search. Ranked by the longest rank span, then the makespan.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from ..core.ir.actions import Action
from ..core.cost.costs import Costs, StageCosts
from ..core.ir.errors import ScheduleError
from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ._build import require
from ._progress import Progress
from ._zb_search import hill_climb, list_schedule
from ._zb_timing import Candidate, Unplaceable, evaluate, pick_best

__all__ = ["MODES", "select"]

MODES = ("best", "reference")
Ranks = Sequence[Sequence[Action]]


def select(
    name: str,
    options: tuple[tuple[str, object], ...],
    *,
    placement: Placement,
    m: int,
    table: StageCosts,
    limit: float,
    costs: Costs | None,
    mode: str,
    search: int,
    reference: Iterable[tuple[object, Ranks]],
    extra: Iterable[tuple[str, Ranks]] = (),
    baseline: str = "reference greedy",
) -> Schedule:
    require(mode in MODES, f"{name}: mode must be one of {MODES}, got {mode!r}")
    require(isinstance(search, int) and search >= 0, f"{name}: search must be an integer >= 0, got {search!r}")
    progress = Progress(f"{name} p={placement.num_ranks} m={m}")

    def schedule_of(ranks: Ranks) -> Schedule:
        return Schedule(name, placement.num_ranks, m, placement, tuple(tuple(r) for r in ranks), options=options)

    candidates: list[Candidate] = [
        evaluate(f"reference {knobs}", schedule_of(ranks), costs) for knobs, ranks in reference
    ]
    progress.step(f"{baseline}: {len(candidates)} candidates")
    if mode == "reference":
        fitting = [c for c in candidates if c.peak <= limit + 1e-9]
        if not fitting:
            raise ScheduleError(
                f"{name}: the {baseline} cannot fit memory_limit={limit:g} at p={placement.num_ranks}, m={m}; "
                "use mode='best', or raise the limit"
            )
        return schedule_of(min(fitting, key=lambda c: c.max_span).ranks)  # its own objective, first on ties
    candidates += [evaluate(label, schedule_of(ranks), costs) for label, ranks in extra]
    progress.step(f"{len(candidates)} candidates evaluated")
    for prefer in ("B", "F"):
        try:
            ranks = list_schedule(placement, m, table, limit, prefer=prefer)
        except Unplaceable:
            continue
        candidates.append(evaluate(f"list prefer={prefer}", schedule_of(ranks), costs))
        progress.step(f"list schedule (prefer {prefer}) done")
    best = pick_best(candidates, limit)
    if best is None:  # the list scheduler is memory-safe above the floor; this is a bug, not bad input
        raise RuntimeError(f"{name}: no candidate fits memory_limit={limit} at p={placement.num_ranks}, m={m}")
    progress.step(f"best so far: {best.origin}; local search ({search} steps at most)")
    polished = hill_climb(schedule_of(best.ranks), costs, limit, search)
    progress.step("local search done")
    return schedule_of(pick_best([best, evaluate("local search", polished, costs)], limit).ranks)
