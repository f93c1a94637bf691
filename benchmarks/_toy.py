"""Which schedules the runtime benchmarks can run on the toy model (`pipeblocks.models.toy`)."""
from __future__ import annotations

from typing import Sequence

from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.schedules import get

__all__ = ["toy_schedules"]


def toy_schedules(p: int, m: int, names: Sequence[str]) -> list[str]:
    """The named schedules a toy model of 2p blocks can run at (p, m): those that build,
    split no sequences, and whose stage count divides the 2p blocks."""
    runnable = []
    for name in names:
        try:
            schedule = get(name)(p=p, m=m)
        except ScheduleError:
            continue
        if schedule.seq_chunks == 1 and (2 * p) % schedule.num_stages == 0:
            runnable.append(name)
    return runnable
