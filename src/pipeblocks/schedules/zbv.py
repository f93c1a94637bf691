"""ZB-V: zero bubble at 1F1B's memory on the V placement (rank i holds stages i and 2p-1-i).

    pipeblocks simulate zb-v -p 4 -m 8
    python -c "from pipeblocks.schedules import get; from pipeblocks.sim import Costs; \
        print(get('zb-v')(p=4, m=8, cost_aware=True, costs=Costs(3, 4, 2)).to_text())"

Two builders behind one name. The handcrafted order of the ZB paper ignores costs; the
cost-aware build schedules from the pass costs under a memory limit (default 1F1B's peak,
p*M_B, or the handcrafted order's peak where unequal stage activations lift it above that). `cost_aware` defaults to the cost-aware build exactly when the given costs are not
uniform (unequal F/B/W times, communication time, per-stage differences or M_W < M_B;
`_cost_aware.uniform`); `cost_aware=False` keeps the handcrafted order. Cost-aware,
`mode="reference"` is the ZB paper's V greedy (`_zbv_reference`), `mode="best"` (default)
the best by simulation of that greedy's knob grid, the handcrafted order (as is and with
its Ws placed again for the costs), our memory-safe list scheduler, then `search` steps of
local search; chosen by the longest rank span, then the makespan.
"""
from __future__ import annotations

from ..core.ir.actions import Action
from ..core.ir.errors import ScheduleError
from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ..core.cost.costs import Costs
from ._build import B, F, W
from ._cost_aware import wants_cost_aware
from ._reorder import cost_table, peaks_of
from ._zb_search import refilled
from ._zb_select import select
from ._zb_timing import check_limit, memory_floor
from ._zbv_reference import reference_v_candidates
from .registry import register

__all__ = ["zb_v", "zbv_handcrafted"]


def zbv_handcrafted(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """The handcrafted per-rank orders; built for max(m, 2p-1) microbatches, then the
    passes of microbatches >= m are dropped (idle slots in the paper's figure)."""
    total = max(m, 2 * p - 1)
    ranks = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        made = {}
        out: list[Action] = []

        def run(make, stage: int) -> None:
            key = (make, stage)
            index = made.get(key, 0)
            made[key] = index + 1
            out.append(make(stage, index))

        def count(make, stage: int) -> int:
            return made.get((make, stage), 0)

        for _ in range(2 * (p - r) - 1):  # warm-up: chunk-0 forwards ...
            run(F, down)
        for _ in range(r):  # ... pairs of chunk-1 and chunk-0 forwards ...
            run(F, up)
            run(F, down)
        for _ in range(p - r):  # ... and chunk-1 F, B, W while chunk 0 waits for its first B
            run(F, up)
            run(B, up)
            run(W, up)
        while count(F, up) < count(F, down) or count(F, down) < total:  # steady
            if count(F, down) < total:
                run(F, down)
            for make, stage in ((B, down), (W, down), (F, up), (B, up), (W, up)):
                run(make, stage)
        w_down, w_up = count(W, down), count(W, up)
        for _ in range(r):  # cool-down: backwards first, Ws deferred ...
            run(B, down)
            run(B, up)
        for _ in range(p - r):  # ... then chunk-0 B with the oldest chunk-0 W
            run(B, down)
            out.append(W(down, w_down))
            w_down += 1
        out += [W(up, i) for i in range(w_up, count(B, up))]  # drain
        out += [W(down, i) for i in range(w_down, count(B, down))]
        ranks.append(tuple(a for a in out if a.microbatch < m))
    return tuple(ranks)


@register("zb-v", "ZB-V: V placement, zero bubble at 1F1B's peak with equal costs; cost-aware when costs are given", v=2)
def zb_v(
    *, p: int, m: int, cost_aware: bool | None = None, memory_limit: float | None = None,
    costs: Costs | None = None, mode: str = "best", search: int = 100,
) -> Schedule:
    """ZB-V. Rank r warms up with 2(p-r)-1 chunk-0 forwards, r (chunk-1 F, chunk-0 F) pairs
    and p-r chunk-1 (F, B, W) triples; the steady state repeats F0 B0 W0 F1 B1 W1; the
    cool-down runs the backwards first and the deferred Ws last.

    Peak p*M_B (2p chunk activations, 1F1B's) on every rank. With equal costs and
    m >= 2p-1 every rank is busy from its first pass to its last (zero bubble); rank r
    starts r*T_F/2 after rank 0. Any m >= 1. p=4, m=8 (handcrafted)::

        0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7B0 7W0 7F1 7B1 7W1 7F2 7B2 7W2 7F3 7B3 7W3 0F7 0B0 0W0 7F4 7B4 7W4 0B1 0W1 7F5 7B5 7W5 0B2 0W2 7F6 7B6 7W6 0B3 0W3 7F7 7B7 7W7 0B4 0W4 0B5 0W5 0B6 0W6 0B7 0W7
        1: 1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6B0 6W0 6F2 6B1 6W1 6F3 6B2 6W2 1F6 1B0 1W0 6F4 6B3 6W3 1F7 1B1 1W1 6F5 6B4 6W4 1B2 1W2 6F6 6B5 6W5 1B3 1W3 6F7 6B6 6W6 1B4 6B7 1B5 1W4 1B6 1W5 1B7 1W6 6W7 1W7
        2: 2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5B0 5W0 5F3 5B1 5W1 2F5 2B0 2W0 5F4 5B2 5W2 2F6 2B1 2W1 5F5 5B3 5W3 2F7 2B2 2W2 5F6 5B4 5W4 2B3 2W3 5F7 5B5 5W5 2B4 5B6 2B5 5B7 2B6 2W4 2B7 2W5 5W6 5W7 2W6 2W7
        3: 3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4B0 4W0 3F4 3B0 3W0 4F4 4B1 4W1 3F5 3B1 3W1 4F5 4B2 4W2 3F6 3B2 3W2 4F6 4B3 4W3 3F7 3B3 3W3 4F7 4B4 4W4 3B4 4B5 3B5 4B6 3B6 4B7 3B7 3W4 4W5 4W6 4W7 3W5 3W6 3W7
    """
    if not wants_cost_aware("zb-v", cost_aware, costs):
        if memory_limit is not None:
            raise ScheduleError(
                "zb-v: the handcrafted order has a fixed peak (p*M_B) and takes no memory_limit; "
                "pass cost_aware=True to schedule under a limit"
            )
        return Schedule("zb-v", p, m, Placement.v_shape(p), zbv_handcrafted(p, m))
    placement = Placement.v_shape(p)
    table = cost_table(placement, costs)
    handcrafted = zbv_handcrafted(p, m)
    if memory_limit is None:
        # 1F1B's peak; where stages hold unequal activations the handcrafted order can peak
        # above it, and the cost-aware build may then use as much as the order it replaces
        limit = max(p * memory_floor(placement, table), max(peaks_of(handcrafted, table)))
    else:
        limit = memory_limit
    check_limit("zb-v", limit, placement, table)
    options = (("cost_aware", True), ("memory_limit", limit), ("mode", mode), ("search", search))
    extra = [("handcrafted", handcrafted)]
    if mode == "best":  # a limit below p*M_B may leave the handcrafted F/B order no refill
        extra += [(f"handcrafted, Ws refilled (partial={partial})", again)
                  for partial, again in refilled(placement, handcrafted, table, limit)]
    return select(
        "zb-v", options, placement=placement, m=m, table=table, limit=limit, costs=costs, mode=mode,
        search=search, reference=reference_v_candidates(p, m, table, limit), extra=extra,
        baseline="reference V greedy",
    )
