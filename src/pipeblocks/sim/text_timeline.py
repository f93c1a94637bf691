"""A compact text timeline for the terminal.

One row per rank, one cell per time quantum (the largest step that divides every
duration). A pass shows its kind and microbatch (`F3`, `B3`, `W3`, `BW3`), prefixed by
the rank-local chunk when a rank holds several (`1F3` = chunk 1) and suffixed by the
sequence chunk (`F3.1`); an optimizer step of an asynchronous program shows as `S0`,
`S1`, ... (one of zero cost is covered by the pass that starts with it); `-` continues a
pass over several cells, `.` is idle::

    rank 0  F0 F1 F2 F3 BW0 -- F4 BW1 -- ...
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from itertools import chain
from operator import itemgetter

import numpy as np

from ..core.ir.actions import Action
from ..core.ir.ops import OptimizerStep, Recompute
from ..core.simulator.timeline import Event, Timeline
from ..core.ir.vocab import VocabPass

__all__ = ["render_text_timeline"]

_MAX_CELLS = 4000
_START, _END = itemgetter(1), itemgetter(2)  # an Event's start and end


def render_text_timeline(timeline: Timeline, *, max_cells: int = _MAX_CELLS) -> str:
    schedule = timeline.schedule
    # each rank's event starts and ends as arrays, read once: the quantum and the cells use them
    times = [tuple(np.fromiter(map(field, evs), np.float64, len(evs)) for field in (_START, _END)) for evs in timeline.events]
    quantum = _quantum(timeline, times, max_cells)
    origin = timeline.start
    local_chunk = {s: i for r in range(schedule.p) for i, s in enumerate(schedule.placement.stages_of(r))}
    # a label is a head (chunk and kind) that many events share, then the microbatch (or
    # step) and the sequence chunk: the heads are made once, so a label is one concatenation
    heads: dict[tuple, str] = {}  # by (event type, stage, kind)
    action_heads: dict[tuple, str] = {}  # the same for Actions, by (stage, kind): the most events

    def head(a) -> str:
        key = (type(a), getattr(a, "stage", None), getattr(a, "kind", None))
        text = heads.get(key)
        if text is None and key[0] is VocabPass:  # every rank's vocabulary pass: IF, S, T, IB, no chunk
            text = heads[key] = a.kind
        if text is None:
            letter = "S" if key[0] is OptimizerStep else "R" if key[0] is Recompute else a.kind.value
            text = heads[key] = f"{local_chunk[a.stage]}{letter}" if schedule.v > 1 else letter
        return text

    recomputes = False

    def labels_of(events: Sequence[Event]) -> list[str]:
        nonlocal recomputes
        out = []
        for e in events:
            a = e.action
            if type(a) is Action and a.seq_chunk is None:
                text = action_heads.get((a.stage, a.kind))
                if text is None:
                    text = action_heads[(a.stage, a.kind)] = head(a)
                out.append(text + str(a.microbatch))
            elif type(a) is OptimizerStep:
                out.append(f"{head(a)}{a.step}")
            else:
                recomputes = recomputes or type(a) is Recompute
                text = f"{head(a)}{a.microbatch}"
                chunk = getattr(a, "seq_chunk", None)
                out.append(text if chunk is None else f"{text}.{chunk}")
        return out

    labels = [labels_of(evs) for evs in timeline.events]  # once per event: the width needs them all
    width = max(map(len, chain.from_iterable(labels)), default=1)
    total = max(1, round(timeline.makespan / quantum))
    idle, busy = ".".ljust(width), "-" * width
    rows = []
    for r, names in enumerate(labels):
        cells = [idle] * total
        for i, c in zip(*_cell_owners(*times[r], origin, quantum, total)):
            cells[c] = names[i].ljust(width) if i >= 0 else busy
        rows.append(f"rank {r:<3} " + " ".join(cells).rstrip())
    legend = (
        f"# {schedule.name} p={schedule.p} m={schedule.m} v={schedule.v}: one cell = {quantum:.4g} time units; "
        "F forward, B input-grad, W weight-grad, BW fused backward"
        + (", R recompute" if recomputes else "")
        + ("; leading digit = chunk on the rank" if schedule.v > 1 else "")
        + "; '-' continues, '.' idle"
    )
    return legend + "\n" + "\n".join(rows) + "\n"


def _cell_owners(starts: np.ndarray, ends: np.ndarray, origin: float, quantum: float, total: int) -> tuple[list[int], list[int]]:
    """The cells that a rank's events (their starts and ends, in order) write, in increasing
    order, and for each the index of the event that heads there or -1 where a pass
    continues over it, as writing the events in order would leave them: an event writes its
    label into the cell where it starts and `-` into the cells after, up to the cell where
    it ends; a later event overwrites. Two lists, not a list of pairs: a pair per cell would
    wake the cyclic collector."""
    if not len(starts):
        return [], []
    # np.rint rounds half to even, as round() does, on the same quotients
    # an event that starts in the last half cell (a zero-length optimizer step at the end)
    # rounds to the cell past the end: it writes the last cell
    first = np.minimum(np.rint((starts - origin) / quantum).astype(np.int64), total - 1)
    stop = np.minimum(np.maximum(first + 1, np.rint((ends - origin) / quantum).astype(np.int64)), total)
    spread = np.maximum(stop - first - 1, 0)  # the cells a pass continues over: first + 1 .. stop - 1
    index = np.arange(len(first))
    # all those cells end to end: the k-th cell of pass i's run is first[i] + 1 + k
    runs = np.arange(spread.sum()) + np.repeat(first + 1 - (np.cumsum(spread) - spread), spread)
    written = np.concatenate([first, runs])
    writer = np.concatenate([index, np.repeat(index, spread)])
    owner = np.full(total, -1, dtype=np.int64)
    np.maximum.at(owner, written, writer)  # the last writer of each cell
    cells = np.flatnonzero(owner >= 0)
    owners = owner[cells]
    heads = first[owners] == cells
    return np.where(heads, owners, -1).tolist(), cells.tolist()


def _quantum(timeline: Timeline, times: list[tuple[np.ndarray, np.ndarray]], max_cells: int) -> float:
    """The largest step dividing every duration (as fractions), or a coarser one if too many cells."""
    durations = set(np.unique(np.concatenate([ends[ends > starts] - starts[ends > starts] for starts, ends in times]
                                            or [np.empty(0)])).tolist())
    if not durations:
        return 1.0
    fractions = [Fraction(d).limit_denominator(1000) for d in durations]
    denominator = math.lcm(*(f.denominator for f in fractions))
    step = Fraction(math.gcd(*(int(f * denominator) for f in fractions)), denominator)
    quantum = float(step)
    if timeline.makespan / quantum > max_cells:
        quantum = max(min(durations), timeline.makespan / max_cells)
    return quantum
