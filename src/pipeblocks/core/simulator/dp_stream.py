"""The simulator's data-parallel communication stream (`simulate`), one per rank.

DP ops run on it in program order: each is issued when the compute stream reaches it (the
end of the compute action before it) and starts when the stream is free; its duration is
the link model's (`dp_model`). The compute stream waits only where it needs an op done
(a stage's first pass after its UNSHARD, the end of the step), and those waits are the
rank's exposed communication; the end of the step adds the zero1/zero2 parameter gathers
after the optimizer step (`after_step_gathers`).

At block grain (`dp_units`: DP ops that name a unit, `2UNSHARD.1`) a pass of a stage with
several units runs through them in sub-intervals (F in unit order, B, W and BW in
reverse; each unit's share of the pass from `Costs.blocks`), where the DP ops meet it:

* a unit's gather has to be done only when the pass reaches the unit's first block;
* with `DPCostModel.prefetch` = k (default None: every unit is gathered where the Program
  issues it), unit u >= k of a stage is gathered no earlier than when the stage's next
  pass reaches unit u - k (k = 1: FSDP2's one block ahead);
* a unit's REDUCE_GRAD placed after its stage's weight-gradient pass is issued when that
  pass finishes the unit's blocks, so the reductions pipeline with the pass.

A pass that waits inside is drawn as one event that ends where the last sub-interval
ends and lasts its compute time (the waits show as the gap before it).
"""
from __future__ import annotations

from ..ir.actions import Action, Kind
from ..cost.costs import StageCosts
from ..ir.errors import ScheduleError
from ..ir.ops import DPOp, Recompute
from ..ir.schedule import Schedule
from .timeline import CommEvent, Event

__all__ = ["CommStream", "UnitPass", "UnitPasses", "after_step_gathers"]

_WEIGHT = (Kind.W, Kind.BW)


def after_step_gathers(table: StageCosts, stages) -> list[tuple[str, float]]:
    """The parameter gathers after the optimizer step (zero1, zero2), in stage order."""
    dp = table.data_parallel
    policies = dp.policies(len(table.params))
    out = []
    for s in stages:
        duration = dp.after_step_time(table.params[s], policies[s])
        if duration:
            out.append((f"{s}OPTIMIZER_GATHER", duration))
    return out


class CommStream:
    """One rank's communication stream: DP ops in program order, each issued at the end
    of the compute action before it (`plan`: (index of the next compute action, op text,
    duration)), run one at a time. Advanced lazily: only a pass that needs a gather, and
    the end of the step, look at it."""

    __slots__ = ("plan", "compute", "pos", "free", "events", "exposed")

    def __init__(self, plan: list[tuple[int, str, float]], compute_events: list[Event]) -> None:
        self.plan = plan
        self.compute = compute_events  # the rank's compute events, filled as the simulation runs
        self.pos = 0
        self.free = 0.0
        self.events: list[CommEvent] = []
        self.exposed = 0.0

    def _advance(self, upto: int) -> None:
        """Run the DP ops up to and including plan[upto]."""
        compute = self.compute
        while self.pos <= upto:
            before, text, duration, anchor = self.plan[self.pos]
            if anchor is None:
                issued = compute[before - 1].end if before else 0.0
            else:  # inside a pass: a boundary between its units
                passed, boundary = anchor
                issued = passed.times[boundary]
                if issued is None:  # the lowering's placement guarantees the pass ran first
                    raise RuntimeError(f"{text} is anchored in a pass that has not run yet")
            start = max(issued, self.free)
            self.free = start + duration
            self.events.append(CommEvent(text, start, self.free))
            self.pos += 1

    def wait(self, index: int, now: float) -> float:
        """The compute stream at `now` waits for plan[index]; returns when it may go on."""
        self._advance(index)
        done = self.events[index].end
        if done > now:
            self.exposed += done - now
            return done
        return now

    def finish(self, after_step: list[tuple[str, float]]) -> float:
        """Run what is left, wait for it at the end of the step, then the gathers after
        the optimizer step; returns the rank's step end."""
        self._advance(len(self.plan) - 1)
        compute_end = self.compute[-1].end if self.compute else 0.0
        end = max(compute_end, self.free)
        for text, duration in after_step:
            self.events.append(CommEvent(text, end, end + duration))
            end += duration
        self.free = end
        self.exposed += end - compute_end
        return end


class UnitPass:
    """One pass through a stage's units, timed per unit: `durations` and `waits` (a plan
    index or None) in the order it runs them (`order`: the unit of each position); `times`
    are its boundaries once it has run (position j starts at times[j], the pass ends at
    times[-1])."""

    __slots__ = ("order", "durations", "waits", "times")

    def __init__(self, order: tuple[int, ...], durations: list[float]) -> None:
        self.order = order
        self.durations = durations
        self.waits: list[int | None] = [None] * len(order)
        self.times: list[float | None] = [None] * (len(order) + 1)

    def position(self, unit: int) -> int:
        return self.order.index(unit)

    def run(self, stream: CommStream, now: float) -> float:
        """Run from `now`, waiting where a unit's gather is not done; returns the end."""
        times, t = self.times, now
        for j, duration in enumerate(self.durations):
            wait = self.waits[j]
            if wait is not None:
                t = stream.wait(wait, t)
            times[j] = t
            t += duration
        times[-1] = t
        return t


class UnitPasses:
    """Block grain in `simulate._compile`: which passes run per unit, and where the per-unit DP ops
    are issued and waited (see the module doc)."""

    def __init__(self, table: StageCosts, schedule: Schedule, gates: list) -> None:
        self.table = table
        self.gates = gates  # `simulate._compile`'s gate per compute action
        self.prefetch = table.data_parallel.prefetch
        self.counts = tuple(table.units.count(s) for s in range(schedule.num_stages))
        self.gathers: dict[int, dict[int, int]] = {}  # stage -> unit -> plan index, until its next pass
        self.anchored: dict[int, list[tuple[int, int]]] = {}  # stage -> (plan index, unit) issued in its next pass
        self.last: dict[int, tuple[Action | Recompute, int, float]] = {}  # stage -> its last pass, index, duration
        self.passes: dict[int, UnitPass] = {}  # action index -> its unit pass

    def _pass(self, op, index: int, duration: float) -> UnitPass:
        found = self.passes.get(index)
        if found is not None:
            return found
        stage = op.stage
        kind = Kind.F if type(op) is Recompute else op.kind
        shares = self.table.unit_shares(kind, stage)
        n = len(shares)
        order = tuple(range(n)) if kind is Kind.F else tuple(reversed(range(n)))
        unit_pass = UnitPass(order, [duration * shares[u] for u in order])
        gates = self.gates
        gate = gates[index]
        if gate is not None:  # a whole-stage gather (a stage of one unit) waits at the start
            unit_pass.waits[0] = gate
        gates[index] = unit_pass
        self.passes[index] = unit_pass
        return unit_pass

    def on_pass(self, op, index: int, duration: float, plan: list) -> None:
        """A pass of a stage was compiled at `index`: it waits for the units gathered for it,
        and issues the gathers anchored in it."""
        stage = op.stage
        self.last[stage] = (op, index, duration)
        waiting = self.gathers.pop(stage, None)
        anchored = self.anchored.pop(stage, None)
        if not waiting and not anchored:
            return
        unit_pass = self._pass(op, index, duration)
        for unit, where in (waiting or {}).items():
            unit_pass.waits[unit_pass.position(unit)] = where
        for where, unit in anchored or ():
            before, text, length, _ = plan[where]
            plan[where] = (before, text, length, (unit_pass, unit_pass.position(unit)))

    def on_dp_op(self, op: DPOp, before: int, text: str, duration: float, plan: list) -> None:
        stage, unit = op.stage, op.unit
        if unit >= self.counts[stage]:
            raise ScheduleError(f"{text}: stage {stage} has {self.counts[stage]} unit(s) under these costs")
        anchor = None
        if op.kind == "UNSHARD":
            self.gathers.setdefault(stage, {})[unit] = len(plan)
            if self.prefetch is not None and unit >= self.prefetch:
                self.anchored.setdefault(stage, []).append((len(plan), unit - self.prefetch))
        elif op.kind == "REDUCE_GRAD":
            last = self.last.get(stage)
            # right after the stage's weight-gradient pass: issued when the pass finishes the unit
            if last is not None and last[1] == before - 1 and type(last[0]) is Action and last[0].kind in _WEIGHT:
                passed, index, length = last
                unit_pass = self._pass(passed, index, length)
                anchor = (unit_pass, unit_pass.position(unit) + 1)
        plan.append((before, text, duration, anchor))
