"""A simulated (or measured) Timeline and the metrics read off it.

Definitions (the JSON of `pipeblocks simulate` follows them):
    makespan      last action's end minus first action's start, over all ranks
    busy(r)       total compute time on rank r
    bubble_ratio  (makespan - max_r busy(r)) / makespan
    span(r)       rank r's last end minus its first start
    bubble_ratio_span  (max_r span(r) - max_r busy(r)) / max_r span(r): the papers' bubble
                  rate (the papers' definition; README, Definitions), which leaves out each rank's wait for its first
                  input; "zero bubble" schedules reach 0 here, while bubble_ratio keeps the
                  unavoidable fill, (p-1)*T_F for the last rank
    peak_activation[r]  the largest activation memory rank r holds at any time

With data parallelism (more than one replica, or a sharding policy) the Program holds DP
ops, which run on a communication stream per rank beside the compute stream:
    comm_events[r]  the DP collectives on rank r's communication stream, in order
    comm_time[r]    busy time of rank r's communication stream
    exposed_comm[r] time rank r's compute stream waits on its communication stream: a pass
                  waiting for its parameters' gather, and the end of the step waiting for
                  the gradient reductions (and the zero1/zero2 parameter gather after it)
    step_end[r]     when rank r's step ends (compute and communication); the makespan
                  then runs to the last rank's step end
    static_memory[r]  parameter, gradient and optimizer-state bytes by policy, between steps
                  (the ZeRO closed forms)
    recompute_time[r]  compute time rank r spends re-running forwards (`Recompute` events,
                  counted in busy(r) too)
    recompute_exposed[r]  the part of it that lengthens rank r's step: how much later the
                  rank's step ends than the same Program's without its RECOMPUTE ops
                  (the rest filled waits); empty without recomputation
    recompute_step_cost  the same for the whole step: makespan with the recomputations minus
                  makespan without them (None without recomputation)
    static_memory_peak[r]  the same at the step's peak: gradients at full size before their
                  reduction, zero2/zero3 parameters gathered beside their shard
                  (`dp_model.static_peak_bytes`)
    memory_peak[r]  static plus activation memory at rank r's peak, traced over time where
                  a chunk frees its parameters between visits (zero3-regather); empty when
                  no rank has such a chunk
    memory_need[r]  what rank r needs: memory_peak where traced, else static_memory_peak +
                  peak_activation (the two peaks added, conservative)
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter, sub
from typing import NamedTuple

from ..ir.actions import Action
from ..ir.ops import OptimizerStep, Recompute
from ..ir.schedule import Schedule

__all__ = ["CommEvent", "Event", "Timeline"]


class Event(NamedTuple):
    """One compute op's run on its rank: an action, an optimizer step (`OptimizerStep`,
    in asynchronous programs only) or a recomputation (`Recompute`)."""

    action: Action | OptimizerStep | Recompute
    start: float
    end: float


class CommEvent(NamedTuple):
    """One collective's run on its rank's communication stream; `op` is its text form
    (`2REDUCE_GRAD`, `2UNSHARD`, or `2OPTIMIZER_GATHER` for the zero1/zero2 parameter
    gather after the step)."""

    op: str
    start: float
    end: float


_START, _END = itemgetter(1), itemgetter(2)


@dataclass(frozen=True)
class Timeline:
    """Per rank: the events in execution order and the memory trace.

    memory[r] is a tuple of (time, activation held from that time on).
    """

    schedule: Schedule
    events: tuple[tuple[Event, ...], ...]
    memory: tuple[tuple[tuple[float, float], ...], ...]
    peak_activation: tuple[float, ...]
    comm_events: tuple[tuple[CommEvent, ...], ...] = ()
    exposed_comm: tuple[float, ...] = ()
    step_end: tuple[float, ...] = ()
    static_memory: tuple[float, ...] = ()
    static_memory_peak: tuple[float, ...] = ()
    memory_peak: tuple[float, ...] = ()
    recompute_exposed: tuple[float, ...] = ()
    recompute_step_cost: float | None = None

    @property
    def memory_need(self) -> tuple[float, ...]:
        """Per rank: `memory_peak` where the simulator traced it, else static memory at the
        step's peak plus peak activation."""
        if self.memory_peak:
            return self.memory_peak
        static = self.static_memory_peak or (0.0,) * len(self.peak_activation)
        return tuple(s + a for s, a in zip(static, self.peak_activation))

    @property
    def start(self) -> float:
        compute = min((evs[0].start for evs in self.events if evs), default=0.0)
        # a step with DP ops starts when its first collective does (a gather before any pass)
        return min(compute, *(evs[0].start for evs in self.comm_events if evs)) if self.comm_events else compute

    @property
    def end(self) -> float:
        compute = max((evs[-1].end for evs in self.events if evs), default=0.0)
        return max(compute, *self.step_end) if self.step_end else compute

    @property
    def comm_time(self) -> tuple[float, ...]:
        if not self.comm_events:
            return (0.0,) * len(self.events)
        return tuple(sum(e.end - e.start for e in evs) for evs in self.comm_events)

    @property
    def makespan(self) -> float:
        return self.end - self.start

    @property
    def recompute_time(self) -> tuple[float, ...]:
        return tuple(
            sum((e.end - e.start for e in evs if type(e.action) is Recompute), 0.0) for evs in self.events
        )

    def rank_end(self, rank: int) -> float:
        """When rank `rank`'s step ends: its last compute, or its step end with DP ops."""
        compute = self.events[rank][-1].end if self.events[rank] else 0.0
        return max(compute, self.step_end[rank]) if self.step_end else compute

    def busy(self, rank: int) -> float:
        return self._busy[rank]

    @cached_property
    def _busy(self) -> tuple[float, ...]:
        # once per timeline, not once per metric: a large simulation has millions of events;
        # the same left-to-right sum of (end - start) as a generator would give, in C
        return tuple(
            sum(map(sub, map(_END, events), map(_START, events))) for events in self.events
        )

    @property
    def bubble_ratio(self) -> float:
        span = self.makespan
        if span <= 0:
            return 0.0
        return (span - max(self._busy)) / span

    def span(self, rank: int) -> float:
        events = self.events[rank]
        return events[-1].end - events[0].start if events else 0.0

    @property
    def bubble_ratio_span(self) -> float:
        cost = max(self.span(r) for r in range(len(self.events)))
        if cost <= 0:
            return 0.0
        return (cost - max(self._busy)) / cost

    def summary(self) -> dict:
        """The JSON object of `pipeblocks simulate --json`."""
        s = self.schedule
        return {
            "schedule": s.name,
            "p": s.p,
            "m": s.m,
            "v": s.v,
            "seq_chunks": s.seq_chunks,
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "bubble_ratio_span": self.bubble_ratio_span,
            "busy": [self._busy[r] for r in range(s.p)],
            "peak_activation": list(self.peak_activation),
            "comm_time": list(self.comm_time),
            "exposed_comm": list(self.exposed_comm) or [0.0] * s.p,
            "recompute_time": list(self.recompute_time),
            **({"recompute_exposed": list(self.recompute_exposed), "recompute_step_cost": self.recompute_step_cost}
               if self.recompute_exposed else {}),
            **({"static_memory": list(self.static_memory)} if self.static_memory else {}),
            **({"static_memory_peak": list(self.static_memory_peak)} if self.static_memory_peak else {}),
            **({"memory_peak": list(self.memory_peak)} if self.memory_peak else {}),
        }
