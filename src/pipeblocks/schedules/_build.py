"""Small helpers shared by generators."""
from __future__ import annotations

from ..core.ir.actions import Action, Kind
from ..core.ir.errors import ScheduleError

__all__ = ["F", "B", "W", "BW", "require"]


def F(stage: int, mb: int) -> Action:
    return Action(stage, Kind.F, mb)


def B(stage: int, mb: int) -> Action:
    return Action(stage, Kind.B, mb)


def W(stage: int, mb: int) -> Action:
    return Action(stage, Kind.W, mb)


def BW(stage: int, mb: int) -> Action:
    return Action(stage, Kind.BW, mb)


def require(condition: bool, message: str) -> None:
    """Raise ScheduleError(message) unless condition holds: generator input checks."""
    if not condition:
        raise ScheduleError(message)
