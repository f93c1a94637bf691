"""Optimizer steps inside a Program: the lowering pass that places them and their check.

A synchronous Program is one optimizer step between two flushes, so it needs no step op.
An asynchronous Program streams the microbatches of several steps through the pipeline
without a flush; each stage then steps its own optimizer as soon as its share of a step's
gradient is complete, while later microbatches are already in flight. With N microbatches
per step, step k of a stage consumes the gradients of microbatches k*N .. k*N+N-1:

    rank 0 (p=2, N=2):  0F0 0F1 0BW0 0F2 0BW1 0STEP0 0F3 0BW2 0F4 0BW3 0STEP1 ...

The rule `check_optimizer_steps` holds a Program to: per stage, steps 0, 1, ... in order,
on the stage's rank; every weight gradient of step k's microbatches (W or fused BW) before
step k and after step k-1 (a later one would add to the next step's gradient). Forwards
and input-gradient passes may cross a step: which weight version they see is the point
(`versions.py`).
"""
from __future__ import annotations

from collections import defaultdict

from ..ir.actions import Action, Kind
from ..ir.errors import ScheduleError
from .lower import Pass
from ..ir.ops import Comm, Op, OptimizerStep
from ..ir.program import Program

__all__ = ["add_optimizer_steps", "check_optimizer_steps", "step_size"]


def add_optimizer_steps(every: int) -> Pass:
    """A lowering pass (`Program -> Program`) that gives every stage an optimizer step
    after the weight gradients of each group of `every` consecutive microbatches.

    A step goes right after the pass that completes its group and that pass's sends, so
    the gradient leaves for the previous stage before the weights change.
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ScheduleError(f"microbatches per optimizer step must be an integer >= 1, got {every!r}")

    def add_steps(program: Program) -> Program:
        schedule = program.schedule
        if schedule.m % every:
            raise ScheduleError(
                f"schedule {schedule.name!r} has m={schedule.m} microbatches, not a whole number of steps of "
                f"{every}: give m a multiple of {every}"
            )
        per_step = every * schedule.seq_chunks
        ranks: list[tuple[Op, ...]] = []
        for ops in program.ranks:
            left: dict[tuple[int, int], int] = defaultdict(lambda: per_step)
            out: list[Op] = []
            due: list[OptimizerStep] = []
            for op in ops:
                if due and not (type(op) is Comm and op.send):
                    out.extend(due)
                    due.clear()
                out.append(op)
                if type(op) is Action and op.kind in (Kind.W, Kind.BW):
                    key = (op.stage, op.microbatch // every)
                    left[key] -= 1
                    if left[key] == 0:
                        due.append(OptimizerStep(*key))
            out.extend(due)
            ranks.append(tuple(out))
        return Program(schedule, tuple(ranks))

    add_steps.__name__ = f"add_optimizer_steps({every})"
    return add_steps


def step_size(program: Program) -> int | None:
    """Microbatches per optimizer step (N), or None for a Program without step ops (synchronous).

    Every stage must hold the same number of steps K, and K must divide m.
    """
    counts = [0] * program.schedule.num_stages
    for ops in program.ranks:
        for op in ops:
            if type(op) is OptimizerStep:
                if op.stage >= len(counts):
                    raise ScheduleError(f"op {op}: stage {op.stage} does not exist (stages 0..{len(counts) - 1})")
                counts[op.stage] += 1
    if not any(counts):
        return None
    if len(set(counts)) != 1:
        raise ScheduleError(
            f"stages hold different numbers of optimizer steps {counts}: every stage steps once per step"
        )
    m, steps = program.schedule.m, counts[0]
    if m % steps:
        raise ScheduleError(
            f"{steps} optimizer steps per stage do not split m={m} microbatches evenly: give m a multiple of {steps}"
        )
    return m // steps


def check_optimizer_steps(program: Program) -> int | None:
    """Raise ScheduleError unless every stage steps in order, after exactly its own step's
    weight gradients (see the module doc). Returns the step size N (None: no steps)."""
    n = step_size(program)
    if n is None:
        return None
    owner = program.schedule.placement.stage_to_rank
    for rank, ops in enumerate(program.ranks):
        done: dict[int, int] = defaultdict(int)  # stage -> steps taken so far
        for pos, op in enumerate(ops):
            if type(op) is OptimizerStep:
                if owner[op.stage] != rank:
                    raise ScheduleError(
                        f"rank {rank}, op {pos} ({op}): stage {op.stage} is placed on rank {owner[op.stage]}; "
                        f"move {op} to rank {owner[op.stage]}"
                    )
                if op.step != done[op.stage]:
                    raise ScheduleError(
                        f"rank {rank}, op {pos} ({op}): stage {op.stage} expects step {done[op.stage]} next; "
                        "each stage's steps run once each, in order 0, 1, ..."
                    )
                done[op.stage] += 1
            elif type(op) is Action and op.kind in (Kind.W, Kind.BW):
                step = op.microbatch // n
                taken = done[op.stage]
                if step < taken:
                    raise ScheduleError(
                        f"rank {rank}, op {pos} ({op}) runs after {op.stage}STEP{step}, the step that consumes "
                        f"its gradient (microbatches {step * n}..{step * n + n - 1}); move it before that step"
                    )
                if step > taken:
                    raise ScheduleError(
                        f"rank {rank}, op {pos} ({op}) runs before {op.stage}STEP{taken}, so its gradient would "
                        f"join step {taken} instead of step {step}; move {op.stage}STEP{taken} before it"
                    )
    return n
