"""V-adaptive: the best V schedule for an activation budget, chosen by simulated time.

Candidates are V building blocks whose shifts between neighbouring ranks set the memory
(downward shift d, upward 1, for d = 1..5, and V-ZB's 4/2), plus two-part blocks that
use one shift on the first ranks and another on the rest, for the levels in between.
Each candidate is built twice, keeping its own peak and filling up to the budget during
warm-up, and replayed under the given costs; the fastest that fits wins.

At unit costs the bubble follows the lower bound of "Pipeline Parallelism with
Controllable Memory": with k chunk activations per rank (a chunk activation is half of
a full stage's, so the budget in peak_activation units is k/2), a rank idles at least
6p - 1 - 3k slots (one slot per chunk pass).

Usage::

    from pipeblocks.schedules import get
    s = get("v-adaptive")(p=8, m=24, memory_limit=5.5)
"""
from __future__ import annotations

from ..core.errors import ScheduleError
from ..core.placement import Placement
from ..core.schedule import Schedule
from ._reorder import CostTable
from .blocks import Block, build_orders
from .registry import register
from .vshape import _checked, v_block, v_block_from_offsets

__all__ = ["v_adaptive", "adaptive_candidates", "two_part_block"]

_EPS = 1e-9
_TRIES = 6  # candidate blocks built per call, the richest in memory first


def two_part_block(p: int, split: int, first: int, rest: int) -> Block | None:
    """A V block with downward shift `first` between ranks 0..split and `rest` below,
    upward shifts 1; None if it does not tile."""
    down = [0]
    for i in range(1, p):
        down.append(down[-1] + (first if i <= split else rest))
    try:
        return v_block_from_offsets(p, down, [p - 1 - i for i in range(p)])
    except ScheduleError:
        return None


def adaptive_candidates(p: int) -> list[tuple[str, Block]]:
    """The blocks v-adaptive chooses from, each with a short label, by lifespan bound."""
    out: list[tuple[str, Block]] = []
    for label, shifts in [(f"shifts {d}/1", (d, 1, d, 1)) for d in range(1, 6)] + [("shifts 4/2", (4, 2, 4, 2))]:
        try:
            out.append((label, v_block(p, shifts)))
        except ScheduleError:  # these shifts collide mod 6 for this p
            continue
    splits = sorted({round(j * (p - 2) / 7) for j in range(8)} - {0}) if p > 2 else []
    for first in range(1, 6):
        for rest in range(1, 6):
            for split in splits if first != rest else ():
                block = two_part_block(p, split, first, rest)
                if block is not None:
                    out.append((f"shifts {first}/1 on ranks 0..{split}, {rest}/1 below", block))
    return sorted(out, key=lambda x: max(x[1].lifespan_bound()))


@register("v-adaptive", "V shape for any activation budget between V-Min's and 1F1B's, chosen by simulated time")
def v_adaptive(*, p: int, m: int, memory_limit: float | None = None, costs: object | None = None) -> Schedule:
    """V-adaptive: among V building blocks of different shifts (memory levels), keep the
    one whose schedule replays fastest under `costs` (makespan, then the longest rank
    span) with a peak of at most `memory_limit` (peak_activation units: 1F1B's peak is p;
    default p). The reorder may spend the rest of the limit on extra warm-up forwards.
    A limit below every candidate's peak is an error that states the smallest feasible
    limit.

    p=4, m=8, memory_limit=3::

        (filled in below)
    """
    _checked(p, m)
    placement = Placement.v_shape(p)
    limit = float(p if memory_limit is None else memory_limit)
    if not limit > 0:
        raise ScheduleError(f"memory_limit must be > 0 (peak_activation units, 1F1B's peak is {p}), got {memory_limit!r}")
    candidates = adaptive_candidates(p)
    frac = placement.stage_fraction
    mem_b = max(CostTable.of(placement, costs).mem_b) / frac
    # the richest few blocks whose lifespan bound fits, and a few just above it (the bound
    # can over-count by a stage activation); the poorest few when nothing fits, for the error
    bounds = [max(block.lifespan_bound(mem_b)) for _, block in candidates]
    sure = [c for c, b in zip(candidates, bounds) if b <= limit + _EPS][::-1][: _TRIES // 2]
    maybe = [c for c, b in zip(candidates, bounds) if limit + _EPS < b <= limit + mem_b + _EPS][: _TRIES // 2]
    best = None
    smallest = float("inf")
    for label, block in sure + maybe or candidates[:3]:
        built = [build_orders(block, m, costs=costs)]
        own = max(built[0][2])
        smallest = min(smallest, own)
        if limit > own + _EPS:  # let the reorder spend the rest of the budget in warm-up
            built.append(build_orders(block, m, costs=costs, memory_cap=limit))
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
