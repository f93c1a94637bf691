"""Cost-aware zero-bubble scheduling under a memory limit: `zb`, with presets `zb-1p`, `zb-2p`.

    pipeblocks simulate zb -p 8 -m 24 --costs 3,4,2 --memory-limit 12
    pipeblocks simulate zb-2p -p 8 -m 24 --costs 18.5,18.1,9.3,0.6

Loop placement, one stage per rank, split backward. The memory limit is per rank, in the
simulator's units (1F1B's peak is p). Two modes:

    "reference"  the ZB paper's greedy over its 2^3 knob grid, kept
                 as the baseline (`_zb_reference`)
    "best"       (default) the best, by simulation, of: the reference greedy's knob grid,
                 ZB-H1/ZB-H2 and their memory-capped variants, our memory-safe list
                 scheduler, then `search` steps of local search from the best of these.

Both choose by the ZB objective: the longest rank span (first pass to last), then the
makespan. "best" holds the reference's candidates, so it is never worse than "reference"
on that objective, and it still finds a schedule where the reference greedy cannot fit.
"""
from __future__ import annotations

from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ..core.cost.costs import Costs
from ._zb_reference import reference_candidates
from ._zb_select import select
from ._reorder import cost_table
from ._zb_timing import check_limit
from .registry import register
from .zero_bubble import lagged_w_program

__all__ = ["zb", "zb_1p", "zb_2p", "build_zb"]



def build_zb(
    name: str, p: int, m: int, memory_limit: float, costs: Costs | None, mode: str, search: int
) -> Schedule:
    placement = Placement.loop(p)
    table = cost_table(placement, costs)
    check_limit(name, memory_limit, placement, table)
    options = (("memory_limit", memory_limit), ("mode", mode), ("search", search))
    return select(
        name, options, placement=placement, m=m, table=table, limit=memory_limit, costs=costs, mode=mode,
        search=search, reference=reference_candidates(p, m, table, memory_limit),
        extra=_lagged_family(p, m, table, memory_limit),
    )


def _lagged_family(p: int, m: int, table, limit: float):
    """ZB-H1, ZB-H2 and versions of them capped to the limit: warm-up w_s, W lag l_s."""
    for label, warm, lag in (
        ("zb-h1", lambda s: p - s, lambda s: s),
        ("zb-h2", lambda s: 2 * (p - s) - 1, lambda s: 2 * s),
        ("capped 1f1b", lambda s: p - s, lambda s: 0),
    ):
        warmups, lags = [], []
        for s in range(p):
            m_b = table.mem_b[s]
            cap = int((limit + 1e-9) // m_b) if m_b > 0 else m
            w = max(1, min(warm(s), cap, warmups[-1] if warmups else m))
            # held at most: w in flight plus l waiting for W at ratio*M_B each
            ratio = table.mem_w_ratio[s]
            room = (limit + 1e-9 - w * m_b) / (ratio * m_b) if ratio * m_b > 0 else m
            lags.append(max(0, min(lag(s), int(room))))
            warmups.append(w)
        yield label, tuple(lagged_w_program(s, m, warmups[s], lags[s]) for s in range(p))


def _default_limit(p: int, costs: Costs | None, factor: int) -> float:
    table = cost_table(Placement.loop(p), costs)
    return factor * p * max(table.mem_b)


@register("zb", "cost-aware greedy zero-bubble schedule under --memory-limit (default: 1F1B's peak)")
def zb(
    *, p: int, m: int, memory_limit: float | None = None, costs: Costs | None = None,
    mode: str = "best", search: int = 100,
) -> Schedule:
    """Greedy zero-bubble schedule under a per-rank memory limit (default p*M_B, 1F1B's
    peak), from the pass costs; see the module docstring for the modes. Any m >= 1.

    With equal costs it reaches ZB-H1's bubble at limit p and zero bubble at 2p (ZB-2p).
    A limit below one microbatch's activation is an error that states the smallest one.
    p=4, m=8, equal costs, limit 4::

        0: 0F0 0F1 0F2 0F3 0B0 0W0 0F4 0B1 0W1 0F5 0B2 0W2 0F6 0B3 0W3 0F7 0B4 0W4 0B5 0W5 0B6 0W6 0B7 0W7
        1: 1F0 1F1 1F2 1B0 1F3 1B1 1W0 1F4 1B2 1W1 1F5 1B3 1W2 1F6 1B4 1W3 1F7 1B5 1W4 1B6 1W5 1B7 1W6 1W7
        2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2W0 2F4 2B3 2W1 2F5 2B4 2W2 2F6 2B5 2W3 2F7 2B6 2W4 2B7 2W5 2W6 2W7
        3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4 3B4 3W1 3F5 3B5 3W2 3F6 3B6 3W3 3F7 3B7 3W4 3W5 3W6 3W7
    """
    limit = _default_limit(p, costs, 1) if memory_limit is None else memory_limit
    return build_zb("zb", p, m, limit, costs, mode, search)


@register("zb-1p", "zb at 1F1B's memory (limit p*M_B): ZB-H1's bubble or better")
def zb_1p(*, p: int, m: int, costs: Costs | None = None, mode: str = "best", search: int = 100) -> Schedule:
    """ZB-1p: `zb` with the limit p*M_B (1F1B's peak). p=4, m=8, equal costs::

        0: 0F0 0F1 0F2 0F3 0B0 0W0 0F4 0B1 0W1 0F5 0B2 0W2 0F6 0B3 0W3 0F7 0B4 0W4 0B5 0W5 0B6 0W6 0B7 0W7
        1: 1F0 1F1 1F2 1B0 1F3 1B1 1W0 1F4 1B2 1W1 1F5 1B3 1W2 1F6 1B4 1W3 1F7 1B5 1W4 1B6 1W5 1B7 1W6 1W7
        2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2W0 2F4 2B3 2W1 2F5 2B4 2W2 2F6 2B5 2W3 2F7 2B6 2W4 2B7 2W5 2W6 2W7
        3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4 3B4 3W1 3F5 3B5 3W2 3F6 3B6 3W3 3F7 3B7 3W4 3W5 3W6 3W7
    """
    return build_zb("zb-1p", p, m, _default_limit(p, costs, 1), costs, mode, search)


@register("zb-2p", "zb at twice 1F1B's memory (limit 2p*M_B): near-zero bubble")
def zb_2p(*, p: int, m: int, costs: Costs | None = None, mode: str = "best", search: int = 100) -> Schedule:
    """ZB-2p: `zb` with the limit 2p*M_B. p=4, m=8, equal costs::

        0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0B0 0F7 0W0 0B1 0W1 0B2 0W2 0B3 0W3 0B4 0W4 0B5 0W5 0B6 0W6 0B7 0W7
        1: 1F0 1F1 1F2 1F3 1F4 1B0 1F5 1B1 1F6 1B2 1F7 1B3 1W0 1B4 1W1 1B5 1W2 1B6 1W3 1B7 1W4 1W5 1W6 1W7
        2: 2F0 2F1 2F2 2B0 2F3 2B1 2F4 2B2 2F5 2B3 2F6 2B4 2F7 2B5 2W0 2B6 2W1 2B7 2W2 2W3 2W4 2W5 2W6 2W7
        3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7 3W0 3W1 3W2 3W3 3W4 3W5 3W6 3W7
    """
    return build_zb("zb-2p", p, m, _default_limit(p, costs, 2), costs, mode, search)
