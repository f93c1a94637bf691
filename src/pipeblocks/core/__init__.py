"""The schedule core: IR, text form, placement, validation, lowering. No torch here."""
from .actions import Action, Kind, parse_actions
from .errors import DeadlockError, ScheduleError
from .lower import check_deadlock, lower
from .placement import Placement
from .program import Comm, Op, Program
from .schedule import Schedule
from .validate import check_structure, validate

__all__ = [
    "Action", "Kind", "parse_actions", "DeadlockError", "ScheduleError", "check_deadlock", "lower",
    "Placement", "Comm", "Op", "Program", "Schedule", "check_structure", "validate",
]
