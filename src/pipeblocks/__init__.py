"""pipeblocks: pipeline-parallel schedules as data, simulated before they run.

    >>> import pipeblocks as pb
    >>> s = pb.schedules.get("1f1b")(p=4, m=8)
    >>> t = pb.simulate(s)
    >>> round(t.bubble_ratio, 4), t.peak_activation[0]
    (0.2727, 4.0)
    >>> program = pb.lower_for(s)          # the Program every consumer runs (sends, receives, DP ops)
"""
from . import schedules
from .core import Action, Kind, Placement, Program, Schedule, ScheduleError, lower_for, validate
from .sim import Costs, Timeline, simulate

__version__ = "0.1.0"
__all__ = [
    "schedules", "Action", "Kind", "Placement", "Program", "Schedule", "ScheduleError", "lower_for",
    "validate", "Costs", "Timeline", "simulate", "__version__",
]
