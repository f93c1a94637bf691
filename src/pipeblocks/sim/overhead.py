"""Where a measured run loses time against its simulation.

    from pipeblocks.sim.overhead import overhead_breakdown
    b = overhead_breakdown(measured_timeline, model_costs, unit_s=1e-3)   # model costs in ms
    print(b.excess_pp, b.latency_pp, b.overrun_pp, b.between_pp)

The measured bubble's excess over the model's is split by replaying the same Program in
the simulator with more and more of what was measured:

    1. the model costs, free communication            -> bubble_model
    2. + t_comm, the measured hand-over latency        -> bubble_latency     latency_pp = 2 - 1
    3. + every pass at its measured mean duration       -> bubble_durations   overrun_pp = 3 - 2
    4. the measured run                                -> bubble_measured    between_pp = 4 - 3

so `excess_pp = latency_pp + overrun_pp + between_pp`. `between_pp` is time between passes
that neither the latency nor the passes' durations explain: the runtime's own work between
passes, waits longer than the median hand-over, and processes that were not scheduled in
time (a loaded machine). `excess_over_latency_pp` (4 - 2) is what the runtime adds over a
prediction that already includes the transport. `overrun_pp` may be negative: a longer pass
off the critical path adds busy time, not makespan.

Per-pass figures read directly off the measured Timeline:

* hand-over latency: a consumer's start minus its producer's end on another rank, where the
  consumer was idle waiting for it (the median is the simulator's t_comm);
* local gap: a pass's start minus the end of the pass before it on the same rank, when its
  input was already there: the runtime's time between two passes;
* overrun: a pass's measured duration minus its modelled one.
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections import defaultdict
from dataclasses import dataclass

from ..core.ir.actions import Action, Kind
from ..core.cost.costs import Costs
from ..core.simulator.simulate import simulate
from ..core.simulator.timeline import Timeline

__all__ = ["OverheadBreakdown", "handover_gaps", "local_gaps", "measured_costs", "overhead_breakdown"]


@dataclass(frozen=True)
class OverheadBreakdown:
    """Bubble ratios of the four replays (see the module docstring) and per-pass figures (seconds)."""

    bubble_model: float
    bubble_latency: float
    bubble_durations: float
    bubble_measured: float
    latency_s: float
    """t_comm of replays 2 and 3: the median hand-over latency unless given."""
    handovers: int
    """Hand-overs that were waited for (the latency is their median)."""
    local_gap_s: float
    """Mean time between two passes of one rank when the second's input was already there."""
    overrun_s: float
    """Mean measured minus modelled duration of a pass."""
    passes: int

    @property
    def excess_pp(self) -> float:
        return 100.0 * (self.bubble_measured - self.bubble_model)

    @property
    def latency_pp(self) -> float:
        return 100.0 * (self.bubble_latency - self.bubble_model)

    @property
    def overrun_pp(self) -> float:
        return 100.0 * (self.bubble_durations - self.bubble_latency)

    @property
    def between_pp(self) -> float:
        return 100.0 * (self.bubble_measured - self.bubble_durations)

    @property
    def excess_over_latency_pp(self) -> float:
        return 100.0 * (self.bubble_measured - self.bubble_latency)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for name in ("excess_pp", "latency_pp", "overrun_pp", "between_pp", "excess_over_latency_pp"):
            out[name] = getattr(self, name)
        return out


def overhead_breakdown(measured: Timeline, model: Costs, *, unit_s: float = 1.0,
                       latency_s: float | None = None) -> OverheadBreakdown:
    """Split `measured`'s bubble excess over `model` (see the module docstring).

    measured: a Timeline in seconds (the runtime's `StepResult.timeline`).
    model: the cost model the run emulates or is compared with, in units of `unit_s`
        seconds (1e-3 for costs in ms); its t_comm is ignored.
    latency_s: the hand-over latency for replays 2 and 3; None: the measured median.
    """
    if not unit_s > 0:
        raise ValueError(f"unit_s must be a positive number of seconds per cost unit, got {unit_s!r}")
    if latency_s is not None and not latency_s >= 0:
        raise ValueError(f"latency_s must be >= 0 seconds, got {latency_s!r}")
    schedule = measured.schedule
    gaps = handover_gaps(measured)
    latency = latency_s if latency_s is not None else (statistics.median(gaps) if gaps else 0.0)
    free = dataclasses.replace(model, t_comm=0.0)
    with_latency = dataclasses.replace(model, t_comm=latency / unit_s)
    durations = dataclasses.replace(measured_costs(measured, unit_s), t_comm=latency / unit_s)
    table = free.for_schedule(schedule)
    overruns = [e.end - e.start - unit_s * table.duration(e.action.kind, e.action.stage, e.action.seq_chunk or 0)
                for events in measured.events for e in events if type(e.action) is Action]
    local = local_gaps(measured)
    return OverheadBreakdown(
        bubble_model=simulate(schedule, free).bubble_ratio,
        bubble_latency=simulate(schedule, with_latency).bubble_ratio,
        bubble_durations=simulate(schedule, durations).bubble_ratio,
        bubble_measured=measured.bubble_ratio,
        latency_s=latency,
        handovers=len(gaps),
        local_gap_s=statistics.fmean(local) if local else 0.0,
        overrun_s=statistics.fmean(overruns) if overruns else 0.0,
        passes=len(overruns),
    )


def measured_costs(measured: Timeline, unit_s: float = 1.0) -> Costs:
    """Per global stage, the mean measured duration of each pass kind, in units of `unit_s`
    seconds. A fused BW counts as B where the stage has no split B (then W = 0); with
    sequence chunks a stage's cost is k times its mean chunk pass (the default even shares)."""
    schedule = measured.schedule
    k = schedule.seq_chunks
    durations: dict[tuple[int, Kind], list[float]] = defaultdict(list)
    for events in measured.events:
        for e in events:
            if type(e.action) is Action:  # a recomputation is modelled as its forward
                durations[(e.action.stage, e.action.kind)].append(e.end - e.start)

    def mean(stage: int, kind: Kind) -> float:
        values = durations.get((stage, kind))
        return k * statistics.fmean(values) / unit_s if values else 0.0

    S = schedule.num_stages
    split = [(s, Kind.B) in durations for s in range(S)]
    return Costs(
        t_f=tuple(mean(s, Kind.F) for s in range(S)),
        t_b=tuple(mean(s, Kind.B) if split[s] else mean(s, Kind.BW) for s in range(S)),
        t_w=tuple(mean(s, Kind.W) if split[s] else 0.0 for s in range(S)),
    )


def handover_gaps(timeline: Timeline) -> list[float]:
    """Delays from a producer's end to its consumer's start on another rank, where the consumer
    was idle waiting for it: what a hop between ranks costs (the simulator's t_comm)."""
    schedule = timeline.schedule
    rank_of = schedule.placement.rank_of
    done = _produced(timeline)
    gaps = []
    for rank, events in enumerate(timeline.events):
        previous_end = None
        for e in events:
            a = e.action
            if type(a) is not Action:  # a recomputation waits on nothing: the rank was busy
                previous_end = e.end
                continue
            source = a.stage - 1 if a.kind is Kind.F else a.stage + 1
            if a.kind is not Kind.W and 0 <= source < schedule.num_stages and rank_of(source) != rank:
                ready = done.get((source, a.microbatch, a.seq_chunk or 0, a.kind.is_backward))
                if ready is not None and (previous_end is None or previous_end <= ready):
                    gaps.append(max(0.0, e.start - ready))
            previous_end = e.end
    return gaps


def local_gaps(timeline: Timeline) -> list[float]:
    """Per rank, a pass's start minus the previous pass's end, where the pass's input was
    already there when the previous one ended (from the same rank, or from another rank
    before that end): time the runtime itself spent between two passes."""
    schedule = timeline.schedule
    done = _produced(timeline)
    gaps = []
    for events in timeline.events:
        for before, e in itertools.pairwise(events):
            a = e.action
            if type(a) is not Action:
                continue
            source = a.stage - 1 if a.kind is Kind.F else a.stage + 1
            ready = None
            if a.kind is not Kind.W and 0 <= source < schedule.num_stages:
                ready = done.get((source, a.microbatch, a.seq_chunk or 0, a.kind.is_backward))
            if ready is None or ready <= before.end:
                gaps.append(max(0.0, e.start - before.end))
    return gaps


def _produced(timeline: Timeline) -> dict[tuple[int, int, int, bool], float]:
    """(stage, microbatch, chunk, backward) -> end of the pass that produced that tensor."""
    done = {}
    for events in timeline.events:
        for e in events:
            a = e.action
            if type(a) is Action and a.kind is not Kind.W:
                done[(a.stage, a.microbatch, a.seq_chunk or 0, a.kind.is_backward)] = e.end
    return done
