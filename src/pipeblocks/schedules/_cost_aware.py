"""Cost-aware builds of the fixed-pattern V schedules (`zb-v`, `v-zb`, `v-half`, `v-min`).

The patterns are laid out for equal pass costs. When the caller gives other costs, the
generators keep the pattern's memory level (its peak under those costs, or the caller's
limit) and choose, by simulation under the costs, among: the pattern itself, the pattern
with its Ws placed again for the costs (`refill_weights`), the caller's extra candidates
(the reference V greedy, other blocks), our memory-safe list scheduler, then `search`
steps of local search. The ranking is the zero-bubble papers' objective: the longest rank
span, then the makespan. The pattern is a candidate, so the result is never worse than it.
"""
from __future__ import annotations

from collections.abc import Iterable

from ..core.cost.costs import Costs
from ..core.ir.errors import ScheduleError
from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ._reorder import cost_table, peaks_of
from ._zb_search import refilled
from ._zb_select import Ranks, select
from ._zb_timing import check_limit

__all__ = ["cost_aware_v", "uniform", "wants_cost_aware"]


def wants_cost_aware(name: str, cost_aware: bool | None, costs: Costs | None) -> bool:
    """`cost_aware` as given, or by default: True exactly when the given costs are not
    uniform (the fixed patterns are laid out for uniform costs: equal F, B and W times on
    every stage, no communication time, equal activation per stage, B keeping all of it
    until W). Unit costs, or all of them scaled alike (a sequence chunk's share), are
    uniform."""
    if cost_aware is None:
        return costs is not None and not uniform(costs)
    if not isinstance(cost_aware, bool):
        raise ScheduleError(f"{name}: cost_aware must be True, False or None (by the costs), got {cost_aware!r}")
    return cost_aware


def uniform(costs: Costs) -> bool:
    """Equal F/B/W times on every stage, no communication time, equal activation per
    stage and M_W = M_B: the costs the fixed patterns are laid out for."""

    def values(x) -> set[float]:
        return set(x) if isinstance(x, tuple) else {x}

    times = values(costs.t_f) | values(costs.t_b) | values(costs.t_w)
    return len(times) == 1 and costs.t_comm == 0 and len(values(costs.mem_b)) == 1 and values(costs.mem_w_ratio) == {1}


def cost_aware_v(
    name: str,
    p: int,
    m: int,
    pattern: Ranks,
    costs: Costs | None,
    *,
    memory_limit: float | None = None,
    search: int = 100,
    reference: Iterable[tuple[object, Ranks]] = (),
    extra: Iterable[tuple[str, Ranks]] = (),
    options: tuple[tuple[str, object], ...] = (),
) -> Schedule:
    """The best V-placement schedule under `costs` within the memory limit (default: the
    pattern's own peak under the costs); see the module docstring."""
    placement = Placement.v_shape(p)
    table = cost_table(placement, costs)
    limit = max(peaks_of(pattern, table)) if memory_limit is None else memory_limit
    check_limit(name, limit, placement, table)
    options = (("cost_aware", True), ("memory_limit", limit), ("search", search), *options)
    seeds = [("pattern", pattern), *extra]
    candidates = list(seeds)
    for label, ranks in seeds:
        candidates += [(f"{label}, Ws refilled", again) for _, again in refilled(placement, ranks, table, limit)]
    return select(
        name, options, placement=placement, m=m, table=table, limit=limit, costs=costs, mode="best",
        search=search, reference=reference, extra=candidates, baseline="reference V greedy",
    )
