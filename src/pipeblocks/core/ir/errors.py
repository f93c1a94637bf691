"""Errors raised for schedules that cannot run.

`ScheduleError` is a `ValueError`: bad input, never a bug. Its message names the rank,
the action in text form and what to change, so a CLI can print it as it is.
"""
from __future__ import annotations

__all__ = ["ScheduleError", "DeadlockError", "check_counts"]


class ScheduleError(ValueError):
    """A schedule is incomplete, out of order, or does not fit its placement."""


class DeadlockError(ScheduleError):
    """A lowered program would block forever: every unfinished rank waits on another."""


def check_counts(**values: int) -> None:
    """ScheduleError naming the first of `values` (name=count) that is not an integer >= 1."""
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be an integer >= 1, got {value!r}")
