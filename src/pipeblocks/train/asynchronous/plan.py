"""An asynchronous run as a list of Programs: warm-up steps, then asynchronous segments
that end where the run drains.

    >>> plan_segments(steps=10, warmup=2, start=0, save_every=4)
    (Segment(first=0, steps=1, synchronous=True), Segment(first=1, steps=1, synchronous=True),
     Segment(first=2, steps=2, synchronous=False), Segment(first=4, steps=4, synchronous=False),
     Segment(first=8, steps=2, synchronous=False))

A run of `steps` optimizer steps of n microbatches is its W synchronous warm-up steps (one
one-step Program each: a flush after every step), then the schedule's asynchronous form
(no flush) over the rest. A **drain** at step k cuts the asynchronous part there: the
Program of the steps before k (which ends by finishing every microbatch in flight, its
drain), then the Program of the steps from k on (which fills the pipeline again). The
drains a run plans are its save points (every `save_every` steps, counted from step 0) and
its evaluation points (every `eval_every`: the held-out loss sees that step's weights); a stop request (a signal) drains at the next step boundary the first stage has not
started (asynchronous/drain.py), which is where a resumed run begins its next segment.

So a run that drained at k and continued, and a run stopped at k and resumed, train
through the same Programs: with the same weights, optimizer and mode state at k (the
checkpoint), they compute the same losses. An uninterrupted run without save points is one
asynchronous Program, as before.

`nominal_delays` are each stage's largest delay in the steady state of the asynchronous
form (p-1-s for 1F1B with one microbatch per step, ceil((p-1-s)/n) in general): T2's
gamma = D^(1/nominal delay) is set from them, so it does not depend on how a run is cut.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...core.ir.program import Program
from ...core.ir.schedule import Schedule
from ...core.lowering.versions import WeightVersions, weight_versions
from ...schedules.asynchronous import ASYNC_FORMS

__all__ = ["Segment", "nominal_delays", "plan_segments", "run_segments", "run_versions", "segment_program"]


@dataclass(frozen=True)
class Segment:
    """Steps first .. first+steps-1 of a run, as one Program."""

    first: int
    steps: int
    synchronous: bool

    @property
    def end(self) -> int:
        """The step after the segment's last: the step a drain at its end saves."""
        return self.first + self.steps


def plan_segments(*, steps: int, warmup: int, start: int = 0, save_every: int = 0,
                  eval_every: int = 0) -> tuple[Segment, ...]:
    """The Programs of a run from step `start` to `steps` (see the module doc); the run also
    drains where `--eval-every` evaluates, so the held-out loss sees the weights of that step."""
    if not 0 <= start < steps:
        raise ValueError(f"start step {start} must be in 0 .. {steps - 1}")
    out = [Segment(k, 1, True) for k in range(start, min(warmup, steps))]
    k = max(start, warmup)
    while k < steps:
        end = min([steps] + [(k // every + 1) * every for every in (save_every, eval_every) if every])
        out.append(Segment(k, end - k, False))
        k = end
    return tuple(out)


def run_segments(cfg, *, start: int = 0) -> tuple[Segment, ...]:
    """The Programs of the run `cfg` (a TrainConfig with --async) from step `start`: drained
    at its save points and, outside --verify (which evaluates nothing), its evaluation points."""
    ck = cfg.checkpoint
    return plan_segments(steps=cfg.steps, warmup=cfg.async_mode.sync_warmup_steps, start=start,
                         save_every=ck.save_every if ck else 0, eval_every=0 if cfg.verify else cfg.eval_every or 0)


def segment_program(schedule: Schedule, segment: Segment) -> Program:
    """The Program of one segment: the asynchronous form over its steps (one step for a
    synchronous one: the same as a flush after it)."""
    return ASYNC_FORMS[schedule.name](p=schedule.p, n=schedule.m, steps=segment.steps)


def run_versions(schedule: Schedule, segments: tuple[Segment, ...], *, prefix: bool = True) -> WeightVersions:
    """The weight version every forward and backward of the whole run sees, indexed by the
    run's microbatch (the steps before the first segment, already trained, as synchronous;
    `prefix=False`: the segments' own, from their first microbatch)."""
    n, stages = schedule.m, schedule.num_stages
    first = segments[0].first
    versions = WeightVersions.synchronous(stages, n, first) if first and prefix else None
    for segment in segments:
        part = (WeightVersions.synchronous(stages, n, 1) if segment.synchronous
                else weight_versions(segment_program(schedule, segment)))
        versions = part if versions is None else versions.then(part)
    return versions


def nominal_delays(schedule: Schedule) -> tuple[int, ...]:
    """Each stage's largest delay in the asynchronous form's steady state."""
    steady = weight_versions(ASYNC_FORMS[schedule.name](p=schedule.p, n=schedule.m, steps=schedule.p + 2))
    return tuple(steady.max_delay(s) for s in range(schedule.num_stages))
