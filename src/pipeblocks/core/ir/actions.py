"""Compute actions and their compact text form.

An action is one pass of one microbatch through one stage::

    2F5      forward of stage 2, microbatch 5
    0B3      input-gradient backward (papers' B; torch's I) of stage 0, microbatch 3
    1W3      weight-gradient backward of stage 1, microbatch 3
    0BW2     fused backward (B and W together; torch's B) of stage 0, microbatch 2
    0B3.1    as 0B3, for sequence chunk 1 (Seq1F1B)

`Action.parse(str(a)) == a` for every action.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from .errors import ScheduleError

__all__ = ["Kind", "Action", "parse_actions"]


class Kind(str, Enum):
    """The pass an action runs."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"

    @property
    def is_backward(self) -> bool:
        return self is not Kind.F

    def __str__(self) -> str:  # "F", not "Kind.F"
        return self.value


_ACTION_RE = re.compile(r"^(\d+)(BW|F|B|W)(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One pass (`kind`) of `microbatch` through global `stage`.

    `seq_chunk` is the sequence chunk for sequence-split schedules (Seq1F1B) and
    `None` otherwise.
    """

    stage: int
    kind: Kind
    microbatch: int
    seq_chunk: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0 or self.microbatch < 0 or (self.seq_chunk is not None and self.seq_chunk < 0):
            raise ScheduleError(f"action {self}: stage, microbatch and sequence chunk must be >= 0")

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
        return text if self.seq_chunk is None else f"{text}.{self.seq_chunk}"

    @property
    def unit(self) -> tuple[int, int, int]:
        """The (stage, microbatch, sequence chunk) this pass belongs to; chunk None reads 0."""
        return (self.stage, self.microbatch, self.seq_chunk or 0)

    def with_kind(self, kind: Kind) -> Action:
        return Action(self.stage, kind, self.microbatch, self.seq_chunk)

    @staticmethod
    def parse(text: str) -> Action:
        """Parse the text form (`2F5`, `0BW2`, `0B3.1`); a clear error otherwise."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected <stage><F|B|W|BW><microbatch>[.<seq chunk>], "
                "for example 2F5, 0BW2 or 0B3.1"
            )
        stage, kind, mb, chunk = match.groups()
        return Action(int(stage), Kind(kind), int(mb), None if chunk is None else int(chunk))


def parse_actions(text: str) -> tuple[Action, ...]:
    """Parse a whitespace-separated list of actions."""
    return tuple(Action.parse(token) for token in text.split())
