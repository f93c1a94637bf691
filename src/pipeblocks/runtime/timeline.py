"""The measured Timeline: real start and end of every action on every rank.

Each rank records its actions against `time.perf_counter()` (a clock shared by the
processes of one machine); `gather_timeline` collects them on group rank 0 and returns a
`pipeblocks.sim.Timeline`, with times in seconds from the earliest action, so the
simulator's metrics (makespan, bubble ratio) and plots apply unchanged. Memory traces are
the ranks' saved-activation bytes over the same clock. Across machines the clocks are not
aligned; compare per-rank spans there, not cross-rank gaps.
"""
from __future__ import annotations

import torch.distributed as dist

from ..core.ir.schedule import Schedule
from ..core.simulator.timeline import Event, Timeline

__all__ = ["gather_timeline", "to_timeline"]


def to_timeline(schedule: Schedule, per_rank: list[dict]) -> Timeline:
    """Build a Timeline from per-rank records {'events': [(action, start, end)], 'memory': [(t, bytes)], 'peak': int}."""
    starts = [e[1] for rec in per_rank for e in rec["events"]]
    zero = min(starts) if starts else 0.0
    events = tuple(tuple(Event(a, s - zero, e - zero) for a, s, e in rec["events"]) for rec in per_rank)
    memory = tuple(tuple((t - zero, float(b)) for t, b in rec["memory"]) for rec in per_rank)
    peaks = tuple(float(rec["peak"]) for rec in per_rank)
    return Timeline(schedule=schedule, events=events, memory=memory, peak_activation=peaks)


def gather_timeline(schedule: Schedule, record, trace, peak: int, group, origin: float) -> Timeline | None:
    """Collective over `group`: every rank sends its record; group rank 0 gets the Timeline."""
    mine = {
        "events": [(a, s, e) for a, s, e in record.events],
        "memory": [(t + origin, b) for t, b in trace],
        "peak": peak,
    }
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    gathered = [None] * world if me == 0 else None
    dist.gather_object(mine, gathered, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if me != 0:
        return None
    return to_timeline(schedule, gathered)
