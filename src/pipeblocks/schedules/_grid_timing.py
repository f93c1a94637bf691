"""Peak activation and replayed times of a slot-grid layout, without building its orders.

`build_orders` compares three layouts of the same passes (tiled, compacted, compacted
with the cool-down Ws floated) by `peaks_of` and `replay` of their per-rank orders. On a
grid every pass starts no earlier than the slot where the passes it waits for end, so
the slots themselves are an order in which every pass's inputs come first: the replay is
one sweep over the slots, each slot's passes (one per rank at most) at once as arrays.
The results are those of `peaks_of` and `replay` on the layout's orders, bit for bit:
the same additions and maxima on the same values, only grouped by slot.
"""
from __future__ import annotations

import numpy as np

from ._grid import KINDS, SlotGrid

__all__ = ["layout_peaks", "layout_replay"]


def layout_peaks(grid: SlotGrid, slots: np.ndarray) -> tuple[float, ...]:
    """Per rank, the peak activation of its passes run in the order of `slots`
    (`peaks_of` of the layout's orders)."""
    alloc, release = grid.effect.T
    out = []
    for ids in grid.rank_orders(slots):
        if not len(ids):
            out.append(0.0)
            continue
        # held after each allocation, as the running sum alloc, release, alloc, ... gives it
        steps = np.empty(2 * len(ids), dtype=np.float64)
        steps[0::2], steps[1::2] = alloc[ids], release[ids]
        out.append(max(0.0, float(np.cumsum(steps)[0::2].max())))
    return tuple(out)


def layout_replay(grid: SlotGrid, slots: np.ndarray) -> tuple[float, float]:
    """(makespan, longest rank span) of the layout's orders under the grid's costs
    (`replay` of them): each pass starts when its rank is free and its inputs have
    arrived, t_comm after their end when they ran on another rank."""
    table = grid.table
    count = grid.count
    if count == 0:
        return (0.0, 0.0)
    num_stages = table.placement.num_stages
    duration = np.array([[table.duration(k, s) for k in KINDS] for s in range(num_stages)], dtype=np.float64)
    order = np.argsort(slots, kind="stable")
    position = np.empty(count + 1, dtype=np.int64)
    position[order] = np.arange(count)
    position[count] = count  # "no input": a slot that ends at -inf
    rank = grid.rank_arr[order]
    dur = duration[grid.stage[order], grid.kind[order]]
    inputs = []
    for dep in grid.deps[:, order]:
        dep_rank = np.where(dep >= 0, grid.rank_arr[dep], -1)
        delay = np.where((dep >= 0) & (dep_rank != rank), table.t_comm, 0.0)
        inputs.append((position[np.where(dep >= 0, dep, count)], delay))
    (dep1, delay1), (dep2, delay2) = inputs
    sorted_slots = slots[order]
    bounds = [0, *(np.flatnonzero(np.diff(sorted_slots)) + 1).tolist(), count]
    end = np.full(count + 1, -np.inf)
    begin = np.empty(count)
    clock = np.zeros(grid.p)
    for a, b in zip(bounds[:-1], bounds[1:]):
        r = rank[a:b]
        start = np.maximum(clock[r], end[dep1[a:b]] + delay1[a:b])
        np.maximum(start, end[dep2[a:b]] + delay2[a:b], out=start)
        finish = start + dur[a:b]
        begin[a:b], end[a:b], clock[r] = start, finish, finish
    ranks, first = np.unique(rank, return_index=True)
    spans = clock.copy()
    spans[ranks] -= begin[first]
    return (float(clock.max()), float(spans.max()))
