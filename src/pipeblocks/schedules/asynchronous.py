"""Asynchronous 1F1B: the steady state of PipeDream and PipeMare, with no flush.

A synchronous schedule is one optimizer step: m microbatches, then a flush. Here the
microbatches of `steps` optimizer steps, N = `n` each, stream through the pipeline as one
1F1B (warm-up and drain once per run, not once per step), and every stage steps its own
optimizer right after its backwards N, 2N, ... (the `add_optimizer_steps` lowering pass),
while the next step's microbatches are already in flight. Forward and backward of one
microbatch can therefore see different versions of their stage's weights; the delay is
read off the Program (`pipeblocks.core.weight_versions`), and what a backward computes
with (a stashed copy, the current weights, an estimate) is the training mode, not the
schedule's business.

These schedules are not in the registry: a registered schedule is one synchronous step,
and every consumer of the registry (the runtime, `compare`, `train`) assumes so.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType

from ..core.ir.errors import ScheduleError
from ..core.lowering.entry import lower_for
from ..core.ir.program import Program
from ..core.ir.schedule import Schedule
from ..core.lowering.steps import add_optimizer_steps
from ..core.lowering.validate import check_program, check_structure
from .classic import one_f_one_b

__all__ = ["ASYNC_FORMS", "async_1f1b", "async_1f1b_schedule", "one_f_one_b_delay"]


def _check(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be an integer >= 1, got {value!r}")


def async_1f1b_schedule(*, p: int, n: int, steps: int) -> Schedule:
    """The compute actions of asynchronous 1F1B: 1F1B over n*steps microbatches without a
    flush (its Program, with the optimizer steps, is `async_1f1b`)."""
    _check(p=p, n=n, steps=steps)
    schedule = one_f_one_b(p=p, m=n * steps)
    return dataclasses.replace(schedule, name="async-1f1b", options=(("n", n), ("steps", steps)))


def async_1f1b(*, p: int, n: int, steps: int) -> Program:
    """Asynchronous 1F1B as a validated Program: p stages on p ranks, `steps` optimizer
    steps of `n` microbatches each, lowered through the normal passes plus the optimizer
    steps, checked for step placement and deadlock.

    Rank r warms up with p-1-r forwards, then alternates F and BW through all n*steps
    microbatches and drains once; `rSTEPk` follows its backward (k+1)*n. p=3, n=2, steps=3
    (transfers left out)::

        0: 0F0 0F1 0F2 0BW0 0F3 0BW1 0STEP0 0F4 0BW2 0F5 0BW3 0STEP1 0BW4 0BW5 0STEP2
        1: 1F0 1F1 1BW0 1F2 1BW1 1STEP0 1F3 1BW2 1F4 1BW3 1STEP1 1F5 1BW4 1BW5 1STEP2
        2: 2F0 2BW0 2F1 2BW1 2STEP0 2F2 2BW2 2F3 2BW3 2STEP1 2F4 2BW4 2F5 2BW5 2STEP2

    0F2 runs at weight version 0 and 0BW2 after 0STEP0, at version 1: microbatch 2 has
    delay 1 at stage 0. The delays per stage are (0 0 1 1 1 1), (0 0 1 0 1 0), (0 ...).
    """
    schedule = async_1f1b_schedule(p=p, n=n, steps=steps)
    check_structure(schedule)
    program = lower_for(schedule, extra_passes=(add_optimizer_steps(n),))
    check_program(program)
    return program


def one_f_one_b_delay(*, p: int, n: int, stage: int, microbatch: int) -> int:
    """The delay tau of `microbatch` at `stage` in asynchronous 1F1B, in closed form.

    Stage s warms up with W = p-1-s forwards, so F(m) follows max(m - W, 0) of its
    backwards and B(m) follows m; each n backwards are one step:
    tau = floor(m/n) - floor(max(m - W, 0)/n). In the steady state (m >= W) that is
    floor(m/n) - floor((m - W)/n), which is floor(W/n) or ceil(W/n).
    """
    _check(p=p, n=n)
    if not 0 <= stage < p or microbatch < 0:
        raise ScheduleError(f"stage {stage} must be in 0..{p - 1} and microbatch {microbatch} >= 0")
    warmup = p - 1 - stage
    return microbatch // n - max(microbatch - warmup, 0) // n


ASYNC_FORMS = MappingProxyType({"1f1b": async_1f1b})
"""Registered schedules with an asynchronous form, and the function (p=, n=, steps=) that
builds that form's Program."""
