"""Schedule generators, by name: `pipeblocks.schedules.get("1f1b")(p=4, m=8)`."""
from .registry import ScheduleSpec, get, names, register, specs

__all__ = ["ScheduleSpec", "get", "names", "register", "specs"]
