"""Steady-state metrics of an asynchronous Program's simulated Timeline.

A synchronous step pays the pipeline's fill and drain every step; its bubble is the
Timeline's `bubble_ratio`. An asynchronous run pays them once per run, so its per-step
figures are measured over the middle steps only, between optimizer steps:

    window(r)      from the end of rank r's step 0 to the end of its step K-2 (K steps in
                   all): steps 1..K-2, leaving out the first (fill) and the last (drain)
    step_time      max_r window(r) / (K - 2)
    busy_per_step  max_r (compute time of rank r inside its window) / (K - 2)
    bubble         (step_time - busy_per_step) / step_time, as `bubble_ratio` per step
    throughput     microbatches per unit time, N / step_time

On a rank with several stages, its step k ends with the last of its stages' steps k.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.ops import OptimizerStep
from .timeline import Timeline

__all__ = ["SteadyState", "steady_state"]


@dataclass(frozen=True)
class SteadyState:
    """Per-step figures over the middle steps of an asynchronous run (see the module doc)."""

    step_size: int
    """microbatches per optimizer step (N)"""
    steps_measured: int
    """middle steps the figures average over (K - 2)"""
    step_time: float
    busy_per_step: float
    bubble: float
    throughput: float

    def summary(self) -> dict:
        return {
            "step_size": self.step_size,
            "steps_measured": self.steps_measured,
            "step_time": self.step_time,
            "busy_per_step": self.busy_per_step,
            "steady_bubble": self.bubble,
            "throughput": self.throughput,
        }


def steady_state(timeline: Timeline) -> SteadyState:
    """The steady-state figures of a simulated asynchronous program (3 or more steps)."""
    ends: list[dict[int, float]] = []
    for events in timeline.events:
        mine: dict[int, float] = {}
        for e in events:
            if type(e.action) is OptimizerStep:
                mine[e.action.step] = max(mine.get(e.action.step, e.end), e.end)
        ends.append(mine)
    counts = {len(mine) for mine in ends}
    steps = counts.pop() if len(counts) == 1 else 0
    if steps == 0:
        raise ValueError(
            "the timeline has no optimizer steps on some rank: steady-state figures need an asynchronous program "
            "(for a synchronous one, read bubble_ratio)"
        )
    if steps < 3:
        raise ValueError(
            f"the run has {steps} optimizer steps; steady-state figures leave out the first (fill) and the last "
            "(drain) step, so simulate 3 or more"
        )
    measured = steps - 2
    windows, busy = [], []
    for events, mine in zip(timeline.events, ends):
        start, end = mine[0], mine[steps - 2]
        windows.append(end - start)
        busy.append(sum(max(0.0, min(e.end, end) - max(e.start, start)) for e in events))
    step_time = max(windows) / measured
    busy_per_step = max(busy) / measured
    bubble = (step_time - busy_per_step) / step_time if step_time > 0 else 0.0
    n = timeline.schedule.m // steps
    return SteadyState(
        step_size=n, steps_measured=measured, step_time=step_time, busy_per_step=busy_per_step, bubble=bubble,
        throughput=n / step_time if step_time > 0 else float("inf"),
    )
