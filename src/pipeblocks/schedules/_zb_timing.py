"""Shared machinery for the cost-aware zero-bubble generators.

`Timer` places passes one at a time on their ranks and keeps, as the greedy schedulers
need them, each pass's end time, each rank's clock, activation memory and accumulated
bubble, and the Ws still pending. Its model is the simulator's, from the same pieces:
the dependency rule is `core.ir.deps.requirements`, durations and memory effects are the
resolved `StageCosts.duration` / `StageCosts.memory`, and a pass starts when its rank is
free and its inputs have arrived, t_comm after they were produced on another rank (as a
lowered receive waits in `core.simulator.simulate`). A Timer lives for one build; nothing here is
shared state.

`Candidate` and `pick_best` evaluate finished orders with the simulator's model and choose
by the ZB objective: the longest rank span (first pass to last pass), then the makespan.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

from ..core.ir.actions import Action, Kind
from ..core.ir.deps import requirements
from ..core.ir.errors import ScheduleError
from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ..core.cost.costs import Costs, StageCosts
from ..core.ir.errors import DeadlockError
from ..core.lowering.validate import check_structure
from ._reorder import peaks_of, replay_spans

__all__ = ["Timer", "Unplaceable", "Candidate", "evaluate", "pick_best", "memory_floor", "check_limit"]


class Unplaceable(Exception):
    """A greedy rule asked for a pass whose inputs are not placed, or that cannot fit memory."""


def memory_floor(placement: Placement, table: StageCosts) -> float:
    """The smallest per-rank activation budget any schedule meets: every rank must hold
    one microbatch on all its stages at once (a V rank keeps chunk 0 while chunk 1 runs)."""
    return max(sum(table.mem_b[s] for s in placement.stages_of(r)) for r in range(placement.num_ranks))


def check_limit(name: str, limit: float, placement: Placement, table: StageCosts) -> None:
    floor = memory_floor(placement, table)
    if not isinstance(limit, (int, float)) or limit < floor - 1e-9:
        raise ScheduleError(
            f"{name}: memory_limit={limit!r} is below what any schedule can meet; the smallest feasible "
            f"limit is {floor:g} (one microbatch's activation on every stage of a rank): raise --memory-limit "
            f"to at least {floor:g}"
        )


class Timer:
    """Greedy placement with the simulator's timing; `order[r]` is rank r's program so far."""

    def __init__(self, placement: Placement, table: StageCosts, memory_limit: float) -> None:
        self.rank_of = placement.stage_to_rank
        self.last = placement.num_stages - 1
        self.table = table
        self.limit = memory_limit + 1e-9
        p = placement.num_ranks
        self.order: list[list[Action]] = [[] for _ in range(p)]
        self.clock = [0.0] * p
        self.mem = [0.0] * p
        self.bubble = [0.0] * p
        self.started = [False] * p
        self.pending: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
        self.end: dict[tuple[Kind, int, int], float] = {}
        # per (kind, stage): its inputs as (kind, stage, delay) and its memory change, from
        # the core's dependency rule and cost table (the microbatch passes through unchanged)
        self._needs: dict[tuple[Kind, int], tuple[tuple[Kind, int, float], ...]] = {}
        self._delta: dict[tuple[Kind, int], float] = {}

    # ---- costs ------------------------------------------------------------------
    def cost(self, kind: Kind, stage: int) -> float:
        return self.table.duration(kind, stage)

    def delta(self, kind: Kind, stage: int) -> float:
        """The pass's net change of its rank's activation memory."""
        value = self._delta.get((kind, stage))
        if value is None:
            alloc, release = self.table.memory(kind, stage)
            value = self._delta[(kind, stage)] = alloc + release
        return value

    def fits(self, kind: Kind, stage: int) -> bool:
        return self.mem[self.rank_of[stage]] + self.delta(kind, stage) <= self.limit

    # ---- dependencies -------------------------------------------------------------
    def _inputs(self, kind: Kind, stage: int) -> tuple[tuple[Kind, int, float], ...]:
        needs = self._needs.get((kind, stage))
        if needs is None:
            rank, t_comm = self.rank_of[stage], self.table.t_comm
            needs = self._needs[(kind, stage)] = tuple(
                (Kind(phase), s, t_comm if self.rank_of[s] != rank else 0.0)
                for phase, s, _, _ in requirements(Action(stage, kind, 0), self.last + 1, 1)
            )
        return needs

    def arrival(self, kind: Kind, stage: int, mb: int) -> float | None:
        """When every input of this pass is available on its rank; None if one is not placed yet."""
        ready = 0.0
        end = self.end
        for need_kind, need_stage, delay in self._inputs(kind, stage):
            done = end.get((need_kind, need_stage, mb))
            if done is None:
                return None
            if done + delay > ready:
                ready = done + delay
        return ready

    def placed(self, kind: Kind, stage: int, mb: int) -> bool:
        return (kind, stage, mb) in self.end

    # ---- placement ----------------------------------------------------------------
    def put(self, kind: Kind, stage: int, mb: int) -> float:
        """Place the pass at the end of its rank's program; returns its end time."""
        rank = self.rank_of[stage]
        ready = self.arrival(kind, stage, mb)
        if ready is None:
            raise Unplaceable(f"{stage}{kind.value}{mb} placed before its inputs")
        if not self.fits(kind, stage):
            raise Unplaceable(f"{stage}{kind.value}{mb} does not fit the memory limit on rank {rank}")
        start = max(self.clock[rank], ready)
        if self.started[rank]:
            self.bubble[rank] += start - self.clock[rank]
        self.started[rank] = True
        end = start + self.cost(kind, stage)
        self.clock[rank] = end
        self.end[(kind, stage, mb)] = end
        self.mem[rank] += self.delta(kind, stage)
        self.order[rank].append(Action(stage, kind, mb))
        if kind is Kind.B:
            self.pending[rank].append((stage, mb))
        return end

    def put_w(self, rank: int) -> None:
        """Run the oldest pending W of this rank."""
        if not self.pending[rank]:
            raise Unplaceable(f"rank {rank} has no pending W to free memory with")
        stage, mb = self.pending[rank].popleft()
        self.put(Kind.W, stage, mb)

    def drain(self) -> None:
        for rank in range(len(self.order)):
            while self.pending[rank]:
                self.put_w(rank)

    def max_bubble(self) -> float:
        return max(self.bubble)

    def ranks(self) -> tuple[tuple[Action, ...], ...]:
        return tuple(tuple(actions) for actions in self.order)


@dataclass(frozen=True)
class Candidate:
    """A finished order, its origin, and how it simulates."""

    origin: str
    ranks: tuple[tuple[Action, ...], ...]
    max_span: float
    makespan: float
    peak: float

    @property
    def key(self) -> tuple[float, float]:
        return (round(self.max_span, 9), round(self.makespan, 9))


def evaluate(origin: str, schedule: Schedule, costs: Costs | None) -> Candidate:
    """Check a complete schedule's structure, replay it (the simulator's timing and memory
    model, without lowering it or keeping events) and summarise it."""
    check_structure(schedule)
    table = (costs or Costs()).for_schedule(schedule)
    replayed = replay_spans(schedule.ranks, table, schedule.m)
    if replayed is None:
        raise DeadlockError(f"{origin}: schedule {schedule.name!r} deadlocks")  # a generator bug
    makespan, spans = replayed
    return Candidate(origin, schedule.ranks, max(spans), makespan, max(peaks_of(schedule.ranks, table)))


def pick_best(candidates: Iterable[Candidate], limit: float) -> Candidate | None:
    """The candidate within the memory limit with the shortest longest span (then makespan)."""
    fitting = [c for c in candidates if c.peak <= limit + 1e-9]
    return min(fitting, key=lambda c: c.key, default=None)
