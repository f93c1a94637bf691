"""Schedule generators, by name: `pipeblocks.schedules.get("1f1b")(p=4, m=8)`; a user's own
with `register` in their module and `load_schedules("my_schedules.py")`."""
from .registry import ScheduleSpec, get, load_schedules, names, register, specs

__all__ = ["ScheduleSpec", "get", "load_schedules", "names", "register", "specs"]
