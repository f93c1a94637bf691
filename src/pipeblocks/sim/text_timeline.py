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
from fractions import Fraction

from ..core.program import OptimizerStep, Recompute
from ..core.timeline import Event, Timeline

__all__ = ["render_text_timeline"]

_MAX_CELLS = 4000


def render_text_timeline(timeline: Timeline, *, max_cells: int = _MAX_CELLS) -> str:
    schedule = timeline.schedule
    quantum = _quantum(timeline, max_cells)
    origin = timeline.start
    local_chunk = {s: i for r in range(schedule.p) for i, s in enumerate(schedule.placement.stages_of(r))}

    def label(event: Event) -> str:
        a = event.action
        if type(a) is OptimizerStep:
            text = f"S{a.step}"
            return f"{local_chunk[a.stage]}{text}" if schedule.v > 1 else text
        text = f"{'R' if type(a) is Recompute else a.kind.value}{a.microbatch}"
        if schedule.v > 1:
            text = f"{local_chunk[a.stage]}{text}"
        if a.seq_chunk is not None:
            text = f"{text}.{a.seq_chunk}"
        return text

    rows = []
    width = max((len(label(e)) for evs in timeline.events for e in evs), default=1)
    total = max(1, round(timeline.makespan / quantum))
    for r, events in enumerate(timeline.events):
        cells = [".".ljust(width)] * total
        for e in events:
            first = round((e.start - origin) / quantum)
            last = max(first + 1, round((e.end - origin) / quantum))
            cells[first] = label(e).ljust(width)
            for c in range(first + 1, min(last, total)):
                cells[c] = "-" * width
        rows.append(f"rank {r:<3} " + " ".join(cells).rstrip())
    legend = (
        f"# {schedule.name} p={schedule.p} m={schedule.m} v={schedule.v}: one cell = {quantum:.4g} time units; "
        "F forward, B input-grad, W weight-grad, BW fused backward"
        + (", R recompute" if any(type(e.action) is Recompute for evs in timeline.events for e in evs) else "")
        + ("; leading digit = chunk on the rank" if schedule.v > 1 else "")
        + "; '-' continues, '.' idle"
    )
    return legend + "\n" + "\n".join(rows) + "\n"


def _quantum(timeline: Timeline, max_cells: int) -> float:
    """The largest step dividing every duration (as fractions), or a coarser one if too many cells."""
    durations = {e.end - e.start for evs in timeline.events for e in evs if e.end > e.start}
    if not durations:
        return 1.0
    fractions = [Fraction(d).limit_denominator(1000) for d in durations]
    denominator = math.lcm(*(f.denominator for f in fractions))
    step = Fraction(math.gcd(*(int(f * denominator) for f in fractions)), denominator)
    quantum = float(step)
    if timeline.makespan / quantum > max_cells:
        quantum = max(min(durations), timeline.makespan / max_cells)
    return quantum
