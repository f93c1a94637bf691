"""Timing and reordering of per-rank pass orders, for block-built schedules.

The reorder loop times many candidate orders, so this module replays an order under the
resolved costs directly, without the validation and lowering `simulate` does, with the
same rules (a pass starts when its rank is free and its inputs have
arrived, t_comm after they were produced on another rank) and the same memory model
(allocate at the start of F, release at the end of B/W/BW). `pipeblocks.core.simulator.simulate`
stays the reference; the tests hold the two in agreement.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.ir.actions import Action, Kind
from ..core.cost.costs import Costs, StageCosts
from ..core.ir.deps import phase_of, requirements
from ..core.ir.placement import Placement
from ._grid import KINDS, SlotGrid

__all__ = ["compact", "cost_table", "float_weights_of", "orders_of", "peaks_of", "replay", "replay_spans"]

Orders = tuple[tuple[Action, ...], ...]


def cost_table(placement: Placement, costs: Costs | None) -> StageCosts:
    """Per-stage costs for `placement`; unit costs for None."""
    return (costs or Costs()).resolve(placement)


def _memory_table(table: StageCosts) -> dict[tuple[int, Kind], tuple[float, float]]:
    """(allocated, released) per (stage, kind)."""
    return {(s, k): table.memory(k, s) for s in range(table.placement.num_stages) for k in Kind}


def peaks_of(orders: Orders, table: StageCosts) -> tuple[float, ...]:
    """Peak activation per rank; it depends on the order alone."""
    memory = _memory_table(table)
    out = []
    for row in orders:
        held = top = 0.0
        for a in row:
            alloc, release = memory[(a.stage, a.kind)]
            held += alloc
            if held > top:
                top = held
            held += release
        out.append(top)
    return tuple(out)


_PHASES = {"F": 0, "B": 1, "W": 2}


def _templates(table: StageCosts):
    """Per (stage, kind): (duration, ((phase slot, delay), ...) needed, (phase slot, ...) done).

    A phase of (stage, microbatch) lives at index microbatch * 3S + phase slot, where the
    slot is 3 * stage + (0 F, 1 B, 2 W): the same rules as `requirements` and `phase_of`
    for one sequence chunk, so the replay loop builds neither actions nor tuple keys."""
    placement = table.placement
    rank_of = placement.stage_to_rank
    out = {}
    for stage in range(placement.num_stages):
        for kind in Kind:
            probe = Action(stage, kind, 0)
            needs = tuple(
                (3 * st + _PHASES[ph], table.t_comm if rank_of[st] != rank_of[stage] else 0.0)
                for ph, st, _, _ in requirements(probe, placement.num_stages, 1)
            )
            done = tuple(3 * stage + _PHASES[ph] for ph, _, _, _ in phase_of(probe))
            out[(stage, kind)] = (table.duration(kind, stage), needs, done)
    return out


def replay(orders: Orders, table: StageCosts, m: int | None = None) -> tuple[float, float]:
    """(makespan, longest rank span) of the orders under the table; a rank's span runs
    from the start of its first pass to the end of its last. Infinite if they cannot
    complete. `m`, the microbatch count, saves a scan when known."""
    spans = replay_spans(orders, table, m)
    if spans is None:
        return (float("inf"), float("inf"))
    return spans[0], max(spans[1])


def replay_spans(
    orders: Orders, table: StageCosts, m: int | None = None
) -> tuple[float, tuple[float, ...]] | None:
    """(makespan, per-rank spans) of the orders under the table, or None if they cannot
    complete (a cross-rank deadlock, or a pass before its own rank's input). `m` (more
    than the largest microbatch index) saves a scan when known."""
    p = len(orders)
    templates = _templates(table)
    width = 3 * table.placement.num_stages
    if m is None:
        m = 1 + max((a.microbatch for row in orders for a in row), default=0)
    done: list[float | None] = [None] * (m * width)
    parked: dict[int, list[int]] = {}
    cursor, clock = [0] * p, [0.0] * p
    first: list[float | None] = [None] * p
    ready = list(range(p))
    while ready:
        r = ready.pop()
        row, pos, now = orders[r], cursor[r], clock[r]
        n = len(row)
        while pos < n:
            a = row[pos]
            base = a.microbatch * width
            duration, needs, phases = templates[(a.stage, a.kind)]
            start = now
            blocked = -1
            for slot, delay in needs:
                t = done[base + slot]
                if t is None:
                    blocked = base + slot
                    break
                t += delay
                if t > start:
                    start = t
            if blocked >= 0:
                parked.setdefault(blocked, []).append(r)
                break
            if first[r] is None:
                first[r] = start
            now = start + duration
            for slot in phases:
                done[base + slot] = now
                if parked:
                    woken = parked.pop(base + slot, None)
                    if woken:
                        ready.extend(woken)
            pos += 1
        cursor[r], clock[r] = pos, now
    if any(cursor[r] < len(orders[r]) for r in range(p)):
        return None
    return max(clock), tuple(clock[r] - (first[r] or 0.0) for r in range(p))


def compact(
    timed: Sequence[Sequence[tuple[int, int, Action]]],
    table: StageCosts,
    caps: Sequence[float],
    *,
    float_weights: bool = True,
) -> Orders:
    """Reorder on the slot grid: visit passes in time order and move each to the earliest
    free slots on its rank after its inputs end, unless that would lift the rank's memory
    above its cap. Moving a pass earlier never breaks a later pass, so the result is valid.

    With `float_weights`, a second round lifts the Ws that run after their rank's last F
    (where memory only falls), compacts again so the cool-down's B chain is not held up
    by them, and puts them back first-in first-out into the earliest free slots.

    `timed[r]` holds (start slot, length, action) for rank r (the tiled block).
    """
    grid, actions = SlotGrid.from_timed(timed, table)
    grid.compact(caps)
    if float_weights:
        float_weights_of(grid, caps)
    return orders_of(grid, actions)


def float_weights_of(grid: SlotGrid, caps: Sequence[float]) -> None:
    """`compact`'s second round, on a grid compacted once."""
    lifted = grid.lift_tail_weights()
    grid.compact(caps, lifted=lifted)
    grid.place_first_free(lifted)


def orders_of(grid: SlotGrid, actions: Sequence[Action] | None = None, slots: np.ndarray | None = None) -> Orders:
    """Per rank, the actions (by pass id) in the order of their slots (`slots`, default
    the grid's now). Without `actions` they are made here, rank by rank in that order, so
    that each rank's actions lie together in memory: validation, lowering and simulation
    read them rank by rank, and at 786,432 actions that halves their time."""
    if actions is not None:
        return tuple(tuple(map(actions.__getitem__, ids.tolist())) for ids in grid.rank_orders(slots))
    return tuple(
        tuple(map(Action, grid.stage[ids].tolist(), map(KINDS.__getitem__, grid.kind[ids].tolist()),
                  grid.microbatch[ids].tolist()))
        for ids in grid.rank_orders(slots)
    )
