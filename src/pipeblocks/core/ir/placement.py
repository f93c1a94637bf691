"""Placement of global stages on pipeline ranks.

Three shapes, for S = p*v stages:

    loop   stage s on rank s mod p          p=2, v=2:  ranks 0 1 0 1
    v      V shape, two stages per rank:    p=2:       ranks 0 1 1 0
           rank i holds stages i and 2p-1-i
    explicit  any map in which every rank holds the same number of stages
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from .errors import ScheduleError, check_counts

__all__ = ["Placement"]


@dataclass(frozen=True)
class Placement:
    """`stage_to_rank[s]` is the rank that runs global stage s; `shape` names the pattern."""

    stage_to_rank: tuple[int, ...]
    shape: str = "explicit"
    _stages_of: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ranks = self.stage_to_rank
        if not ranks:
            raise ScheduleError("placement has no stages: give at least one stage per rank")
        p = max(ranks) + 1
        if min(ranks) < 0:
            raise ScheduleError(f"placement {list(ranks)} names a negative rank")
        stages_of = [[] for _ in range(p)]
        for stage, rank in enumerate(ranks):
            stages_of[rank].append(stage)
        counts = sorted({len(s) for s in stages_of})
        if counts[0] == 0:
            empty = [r for r, s in enumerate(stages_of) if not s]
            raise ScheduleError(f"placement {list(ranks)} leaves rank(s) {empty} without a stage")
        if len(counts) > 1:
            raise ScheduleError(
                f"placement {list(ranks)} gives ranks different stage counts {counts}: "
                "every rank must hold the same number of stages"
            )
        object.__setattr__(self, "_stages_of", tuple(tuple(s) for s in stages_of))

    @staticmethod
    def loop(p: int, v: int = 1) -> Placement:
        check_counts(p=p, v=v)
        return Placement(tuple(s % p for s in range(p * v)), "loop")

    @staticmethod
    def v_shape(p: int) -> Placement:
        check_counts(p=p)
        return Placement(tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p)), "v")

    @property
    def num_ranks(self) -> int:
        return len(self._stages_of)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    @cached_property
    def stage_fraction(self) -> float:
        """The share of one full pipeline stage (1/p of the model) that each stage holds."""
        return self.num_ranks / self.num_stages

    def rank_of(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ScheduleError(f"stage {stage} is out of range: this placement has stages 0..{self.num_stages - 1}")
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return self._stages_of[rank]

    def to_json(self) -> dict:
        return {"shape": self.shape, "stage_to_rank": list(self.stage_to_rank)}

    @staticmethod
    def from_json(data: dict) -> Placement:
        ranks = data.get("stage_to_rank") if isinstance(data, dict) else None
        # bool is an int subclass, and a float rank would be truncated silently: both are errors
        if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise ScheduleError(
                f"placement must be an object with \"stage_to_rank\": a list of whole rank numbers, got {data!r}"
            )
        shape = data.get("shape", "explicit")
        if not isinstance(shape, str):
            raise ScheduleError(f"placement \"shape\" must be a string such as \"loop\" or \"v\", got {shape!r}")
        return Placement(tuple(ranks), shape)
