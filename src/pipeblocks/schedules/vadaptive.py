"""V-adaptive: the best V schedule for an activation budget, chosen by simulated time.

Candidates are V building blocks whose shifts between neighbouring ranks set the memory
(downward shift d, upward 1, for d = 1..5, and V-ZB's 4/2), plus two-part blocks that
use one shift on the first ranks and another on the rest, for the levels in between.
Each candidate is built twice, keeping its own peak and filling up to the budget during
warm-up, and replayed under the given costs; the fastest that fits wins. Under costs that are
not uniform (unequal passes, communication time, ...) each build is also tried with its
Ws placed again for the costs.

At unit costs the bubble follows the lower bound of "Pipeline Parallelism with
Controllable Memory": with k chunk activations per rank (a chunk activation is half of
a full stage's, so the budget in peak_activation units is k/2), a rank idles at least
6p - 1 - 3k slots (one slot per chunk pass). v-adaptive meets it at every even k; at odd
k it is not reachable (an exact search over rank 0's orders rules it out at p=2, 3, 4)
and v-adaptive idles 6p - 3k, one slot more, for p <= 12, using blocks whose turn gaps
are looser than the tightest tiling ones; above p = 12 those extra builds are skipped to
keep a call near 2 s and odd k idles 6p - 3k + 1.

Usage::

    from pipeblocks.schedules import get
    s = get("v-adaptive")(p=8, m=24, memory_limit=5.5)
"""
from __future__ import annotations

import functools

from ..core.ir.errors import ScheduleError, check_counts
from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ._cost_aware import uniform
from ._progress import Progress
from ._reorder import cost_table, peaks_of, replay
from ._zb_search import refilled
from .blocks import Block, build_orders
from .registry import register
from .vshape import v_block_variants

__all__ = ["v_adaptive", "adaptive_candidates"]

_EPS = 1e-9
_TRIES = 6  # candidate blocks built per call, the richest in memory first
_VARIANTS = 3  # extra looser-turn blocks built per call
_VARIANT_P = 12  # above this p the extra builds would take the call past ~2 s


def adaptive_candidates(p: int, *, variants: bool = True) -> list[tuple[str, Block]]:
    """The blocks v-adaptive chooses from, each with a short label, by lifespan bound:
    for each shift family every turn-gap variant with its own lifespans (variant 0 has
    the tightest memory; the others spend a little more and reach an odd number of
    chunk activations with one slot less idle)."""
    return list(_candidates(p, variants))


@functools.lru_cache(maxsize=8)
def _candidates(p: int, variants: bool) -> tuple[tuple[str, Block], ...]:
    # The search over shifts and turn gaps depends on p alone and blocks are immutable:
    # a memory curve (one call per budget) searches once.
    families: list[tuple[str, list[int], list[int]]] = [
        (f"shifts {d}/{u}", [d * i for i in range(p)], [u * (p - 1 - i) for i in range(p)])
        for d, u in [(d, 1) for d in range(1, 6)] + [(4, 2)]
    ]
    splits = sorted({round(j * (p - 2) / 7) for j in range(8)} - {0}) if p > 2 else []
    for first in range(1, 6):
        for rest in range(1, 6):
            for split in splits if first != rest else ():
                down = [0]
                for i in range(1, p):
                    down.append(down[-1] + (first if i <= split else rest))
                families.append((f"shifts {first}/1 on ranks 0..{split}, {rest}/1 below", down, [p - 1 - i for i in range(p)]))
    out: list[tuple[str, Block]] = []
    for label, down, up in families:
        try:
            found = v_block_variants(p, down, up)
        except ScheduleError:  # these shifts collide mod 6 for this p
            continue
        out += [(label if n == 0 else f"{label}, turn variant {n}", block) for n, block in enumerate(found[: None if variants else 1])]
    return tuple(sorted(out, key=lambda x: max(x[1].lifespan_bound())))


@register("v-adaptive", "V shape for any activation budget between V-Min's and 1F1B's, chosen by simulated time", v=2)
def v_adaptive(*, p: int, m: int, memory_limit: float | None = None, costs: object | None = None) -> Schedule:
    """V-adaptive: among V building blocks of different shifts (memory levels), keep the
    one whose schedule replays fastest under `costs` (makespan, then the longest rank
    span) with a peak of at most `memory_limit` (peak_activation units: 1F1B's peak is p;
    default p). The reorder may spend the rest of the limit on extra warm-up forwards.
    A limit below every candidate's peak is an error that states the smallest feasible
    limit.

    p=4, m=8, memory_limit=3::

        0: 0F0 0F1 0F2 0F3 0F4 7F0 7B0 7W0 7F1 7B1 7W1 7F2 7B2 7W2 0B0 0W0 0F5 7F3 7B3 7W3 0B1 0W1 0F6 7F4 7B4 7W4 0B2 0W2 0F7 7F5 7B5 7W5 0B3 0W3 7F6 7B6 7W6 0B4 0W4 7F7 7B7 0B5 7W7 0B6 0W5 0W6 0B7 0W7
        1: 1F0 1F1 1F2 1F3 6F0 6F1 6B0 6W0 6F2 6B1 6W1 1F4 1B0 1W0 6B2 6F3 6W2 1F5 1B1 1W1 6B3 6F4 6W3 1F6 1B2 1W2 6B4 6F5 6W4 1F7 1B3 1W3 6B5 6F6 6W5 1B4 1W4 6B6 6F7 6W6 1B5 6B7 1B6 1W5 6W7 1W6 1B7 1W7
        2: 2F0 2F1 2F2 5F0 5F1 5F2 5B0 5W0 2F3 5B1 2B0 5W1 2W0 5F3 2F4 5B2 2B1 5W2 2W1 5F4 2F5 5B3 2B2 5W3 2W2 5F5 2F6 5B4 2B3 5W4 2W3 5F6 2F7 5B5 2B4 5W5 2W4 5F7 5B6 2B5 5W6 2B6 5B7 2W5 2W6 2B7 5W7 2W7
        3: 3F0 4F0 3F1 4F1 3F2 4F2 4B0 4W0 3B0 3W0 3F3 4F3 4B1 4W1 3B1 3W1 3F4 4F4 4B2 4W2 3B2 3W2 3F5 4F5 4B3 4W3 3B3 3W3 3F6 4F6 4B4 4W4 3B4 3W4 3F7 4F7 4B5 3B5 4B6 3B6 4W5 3W5 4B7 3B7 4W6 3W6 4W7 3W7
    """
    check_counts(p=p, m=m)
    placement = Placement.v_shape(p)
    limit = float(p if memory_limit is None else memory_limit)
    if not limit > 0:
        raise ScheduleError(f"memory_limit must be > 0 (peak_activation units, 1F1B's peak is {p}), got {memory_limit!r}")
    candidates = adaptive_candidates(p, variants=p <= _VARIANT_P)
    frac = placement.stage_fraction
    mem_b = max(cost_table(placement, costs).mem_b) / frac
    # the richest few blocks whose lifespan bound fits, and a few just above it (the bound
    # can over-count by a stage activation); the poorest few when nothing fits, for the error
    bounds = [max(block.lifespan_bound(mem_b)) for _, block in candidates]
    tight = [(c, b) for c, b in zip(candidates, bounds) if "turn variant" not in c[0]]
    sure = [c for c, b in tight if b <= limit + _EPS][::-1][: _TRIES // 2]
    maybe = [c for c, b in tight if limit + _EPS < b <= limit + mem_b + _EPS][: _TRIES // 2]
    if p <= _VARIANT_P:  # plus the richest looser-turn blocks that fit (the odd-k gains, see module doc)
        sure += [c for c, b in zip(candidates, bounds) if b <= limit + _EPS and c not in sure][::-1][:_VARIANTS]
    table = cost_table(placement, costs)
    refill = costs is not None and not uniform(costs)
    best = None
    smallest = float("inf")
    progress = Progress(f"v-adaptive p={p} m={m} memory_limit={limit:g}")
    for label, block in sure + maybe or candidates[:3]:
        progress.step(f"building {label}")
        built = [build_orders(block, m, costs=costs)]
        own = max(built[0][2])
        smallest = min(smallest, own)
        if limit > own + _EPS:  # let the reorder spend the rest of the budget in warm-up
            built.append(build_orders(block, m, costs=costs, memory_cap=limit))
        if refill:  # the blocks are laid out for equal costs: place their Ws again for these
            built += _refilled(placement, built, table, limit)
        for orders, times, peaks in built:
            key = (times, max(peaks))
            if max(peaks) <= limit + _EPS and (best is None or key < best[0]):
                best = (key, orders, label)
    if best is None:
        raise ScheduleError(
            f"memory_limit {limit:g} is below what any V schedule needs for p={p}, m={m}: "
            f"the smallest feasible limit is {smallest:g} (peak_activation units; 1F1B's peak is {p})"
        )
    options = (("block", best[2]), ("memory_limit", limit))
    return Schedule("v-adaptive", p, m, placement, best[1], options=options)


def _refilled(placement: Placement, built, table, limit: float) -> list:
    """Each built order with its Ws placed again under the costs, as (orders, times, peaks)."""
    return [(again, replay(again, table), peaks_of(again, table))
            for orders, _, _ in built for _, again in refilled(placement, orders, table, limit)]
