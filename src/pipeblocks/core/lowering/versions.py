"""Weight versions and delays, read off a Program.

A stage's weights start at version 0; its optimizer step k makes version k+1. Every
forward records the version of its stage's weights when it runs, and so does every
backward (the pass that computes the input gradient: B or fused BW). The delay of
microbatch m at stage s is

    tau_s(m) = version at B(s, m) - version at F(s, m)

the number of updates its forward and backward are apart. Ops of one stage all run on
one rank, in the rank's order, so the version at an op is the number of the stage's step
ops before it there.

For asynchronous 1F1B with N microbatches per step (stage s warms up with W_s = p-1-s
forwards), F(m) follows m - W_s backwards and B(m) follows m, so
tau_s(m) = floor(m/N) - floor(max(m - W_s, 0)/N): floor(W_s/N) or ceil(W_s/N) in the
steady state, P-1-s for N = 1 (`pipeblocks.schedules.asynchronous.one_f_one_b_delay`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.actions import Action, Kind
from ..ir.errors import ScheduleError
from ..ir.ops import OptimizerStep
from ..ir.program import Program
from .steps import check_optimizer_steps

__all__ = ["WeightVersions", "weight_versions", "stashed_versions"]


@dataclass(frozen=True)
class WeightVersions:
    """The weight version each pass of a run saw, per stage and microbatch.

    step_size: microbatches per optimizer step (N); microbatch m belongs to step m // N.
    forward[s][m]: the version of stage s's weights at F(s, m).
    backward[s][m]: the version at the pass that computes its input gradient (B or BW).
    """

    step_size: int
    forward: tuple[tuple[int, ...], ...]
    backward: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        n = self.step_size
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"step_size must be an integer >= 1, got {n!r}")
        if len(self.forward) != len(self.backward) or not self.forward:
            raise ValueError(
                f"forward and backward versions must cover the same stages (>= 1), got "
                f"{len(self.forward)} and {len(self.backward)}"
            )
        m = len(self.forward[0])
        if m == 0 or m % n:
            raise ValueError(f"{m} microbatches are not a whole number (>= 1) of steps of {n}")
        for s, (fwd, bwd) in enumerate(zip(self.forward, self.backward)):
            if len(fwd) != m or len(bwd) != m:
                raise ValueError(f"stage {s}: versions for {len(fwd)} and {len(bwd)} microbatches, expected {m}")
            for mb, (vf, vb) in enumerate(zip(fwd, bwd)):
                # a backward cannot run before its forward, nor after the step that takes its gradient
                if not 0 <= vf <= vb <= mb // n:
                    raise ValueError(
                        f"stage {s}, microbatch {mb}: versions forward {vf}, backward {vb} must satisfy "
                        f"0 <= forward <= backward <= its step {mb // n}"
                    )

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @property
    def microbatches(self) -> int:
        return len(self.forward[0])

    @property
    def steps(self) -> int:
        return self.microbatches // self.step_size

    def delay(self, stage: int, microbatch: int) -> int:
        """tau: updates between the forward and the backward of `microbatch` at `stage`."""
        return self.backward[stage][microbatch] - self.forward[stage][microbatch]

    def delays(self, stage: int) -> tuple[int, ...]:
        """The delay of every microbatch at `stage`, in microbatch order."""
        return tuple(b - f for f, b in zip(self.forward[stage], self.backward[stage]))

    def max_delay(self, stage: int) -> int:
        """The stage's nominal delay: its largest, reached in the steady state."""
        return max(self.delays(stage))

    def step_delay(self, stage: int, step: int) -> int:
        """The largest delay among the microbatches whose gradients step `step` applies."""
        n = self.step_size
        return max(self.delays(stage)[step * n:(step + 1) * n])

    def then(self, later: WeightVersions) -> WeightVersions:
        """This run followed by `later` (its versions counted on from this run's last)."""
        if later.step_size != self.step_size or later.num_stages != self.num_stages:
            raise ValueError(
                f"cannot append a run of {later.num_stages} stages, {later.step_size} microbatches per step to one "
                f"of {self.num_stages} stages, {self.step_size} per step: they must match"
            )
        k = self.steps
        return WeightVersions(
            self.step_size,
            tuple(a + tuple(v + k for v in b) for a, b in zip(self.forward, later.forward)),
            tuple(a + tuple(v + k for v in b) for a, b in zip(self.backward, later.backward)),
        )

    @staticmethod
    def synchronous(num_stages: int, step_size: int, steps: int) -> WeightVersions:
        """A run with a flush after every step: every pass of step k sees version k."""
        for name, value in (("num_stages", num_stages), ("step_size", step_size), ("steps", steps)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        row = tuple(mb // step_size for mb in range(step_size * steps))
        return WeightVersions(step_size, (row,) * num_stages, (row,) * num_stages)


def weight_versions(program: Program) -> WeightVersions:
    """The versions every forward and backward of `program` sees (its optimizer steps
    checked first). A Program without steps is one synchronous step: all versions 0."""
    schedule = program.schedule
    n = check_optimizer_steps(program)
    S, m = schedule.num_stages, schedule.m
    if n is None:
        return WeightVersions.synchronous(S, m, 1)
    forward: list[list[int | None]] = [[None] * m for _ in range(S)]
    backward: list[list[int | None]] = [[None] * m for _ in range(S)]
    for ops in program.ranks:
        version: dict[int, int] = {}
        for op in ops:
            if type(op) is OptimizerStep:
                version[op.stage] = op.step + 1
            elif type(op) is Action and op.kind is not Kind.W:
                table = forward if op.kind is Kind.F else backward
                _record(table, op, version.get(op.stage, 0))
    for table, kind in ((forward, Kind.F), (backward, Kind.BW)):
        for s, row in enumerate(table):
            if None in row:
                missing = Action(s, kind, row.index(None))
                raise ScheduleError(f"program has no {missing} (nor its B): run check_structure on its schedule")
    return WeightVersions(n, tuple(map(tuple, forward)), tuple(map(tuple, backward)))


def _record(table: list[list[int | None]], action: Action, version: int) -> None:
    seen = table[action.stage][action.microbatch]
    if seen is not None and seen != version:
        # sequence chunks of one microbatch are one sample: a step between them has no meaning here
        raise ScheduleError(
            f"{action} sees weight version {version} but an earlier chunk of microbatch {action.microbatch} saw "
            f"{seen}: the chunks of a microbatch must not straddle an optimizer step"
        )
    table[action.stage][action.microbatch] = version


def stashed_versions(program: Program) -> tuple[int, ...]:
    """Per stage, the most weight versions alive at once under weight stashing (PipeDream):
    the current version and the versions that the microbatches between their forward and
    their backward (B or BW) used. A synchronous program keeps 1; asynchronous 1F1B keeps
    max delay + 1, which is p - s for stage s when every microbatch is a step."""
    check_optimizer_steps(program)
    most = [1] * program.schedule.num_stages
    for ops in program.ranks:
        version: dict[int, int] = {}
        in_flight: dict[int, dict[tuple[int, int], int]] = {}
        for op in ops:
            if type(op) is OptimizerStep:
                version[op.stage] = op.step + 1
            elif type(op) is Action and op.kind is not Kind.W:
                key = (op.microbatch, op.seq_chunk or 0)
                if op.kind is Kind.F:
                    in_flight.setdefault(op.stage, {})[key] = version.get(op.stage, 0)
                else:
                    in_flight[op.stage].pop(key, None)
                    continue
            else:
                continue
            # a new version or a new forward: the moments the count can grow
            alive = len(set(in_flight.get(op.stage, {}).values()) | {version.get(op.stage, 0)})
            most[op.stage] = max(most[op.stage], alive)
    return tuple(most)
