"""Where each recomputation runs: in the idle time of its rank, found by the simulator.

    >>> at = place_recompute(schedule, costs, pairs, budget=40e9)
    >>> timeline = simulate(schedule, costs, recompute=pairs, recompute_at=at)
    >>> timeline.recompute_exposed        # per rank, the part that still lengthens the step

A recomputed (stage, microbatch) re-runs its forward before its backward; by default just
before it, where it fills the wait for the incoming gradient when there is one. Often
there is none there, and the recomputation lengthens the step, while the same rank idles
elsewhere: in a bubble, waiting for an activation or a gradient of another microbatch, or
for a parameter gather. A recomputation may run anywhere between its own forward and its
backward, so this moves it into such a wait:

1. Simulate the Program without its recomputations: each rank's waits are the gaps
   between its compute events, each ending at the compute action that waited.
2. For every recomputed unit, in program order, take the latest wait after its forward and no later than its backward that still has room for
   its forward's time, and whose memory allows it: a recomputation run earlier holds its
   activation from there until its backward, so every compute op in between must stay
   within the rank's activation budget (`budget` minus the rank's static memory at the
   step's peak; without a budget, the rank's own peak with the default placement). Memory
   is counted in program order, as the simulator counts it: exactly, whatever the times.
3. Lower with the chosen anchors and simulate; a rank whose step the moves lengthened, or
   whose memory went over, keeps its recomputations where they were.

A unit with no such wait keeps its default place. The RECOMPUTE ops are then where the
runtime runs them too: the placement is part of the lowered Program (`Lowering`'s
`recompute_at`), so `--verify` checks it like any other.
"""
from __future__ import annotations

from collections.abc import Iterable

from ..core.ir.actions import Action, Kind
from ..core.cost.costs import Costs
from ..core.ir.ops import Recompute
from ..core.ir.program import Program
from ..core.ir.schedule import Schedule
from ..core.simulator.simulate import simulate_program
from .program import Lowering

__all__ = ["Anchors", "place_recompute"]

Unit = tuple[int, int, int]
Anchors = dict[Unit, Action]
_EPS = 1e-12


def place_recompute(schedule: Schedule, costs: Costs, pairs: Iterable[tuple[int, int]], *,
                    budget: float | None = None) -> Anchors:
    """The compute action each recomputed unit runs before, for the units moved into idle time
    (the others keep their place before their backward); see the module docstring."""
    pairs = frozenset(pairs)
    if not pairs:
        return {}
    default = _lower(schedule, costs, pairs, None)
    timeline = simulate_program(default, costs)
    if not timeline.recompute_step_cost:
        return {}  # nothing lengthens the step: leave them where they are
    table = costs.for_schedule(schedule)
    plain = Program(schedule, tuple(tuple(op for op in ops if type(op) is not Recompute) for ops in default.ranks))
    waits = simulate_program(plain, costs)
    policies = table.data_parallel.policies(schedule.num_stages) if table.data_parallel.sharding else None
    anchors: Anchors = {}
    for rank, ops in enumerate(default.ranks):
        limit = (budget - timeline.static_memory_peak[rank] if budget is not None and timeline.static_memory_peak
                 else timeline.peak_activation[rank])
        anchors.update(_place_rank(ops, waits.events[rank], table, limit, policies))
    # step 3: a rank the moves made later, or fuller than allowed, keeps its default places
    for _ in range(schedule.p):
        if not anchors:
            return {}
        placed = simulate_program(_lower(schedule, costs, pairs, anchors), costs)
        worse = {r for r in range(schedule.p)
                 if placed.rank_end(r) > timeline.rank_end(r) + _EPS
                 or placed.memory_need[r] > max(timeline.memory_need[r], budget or 0.0) * (1 + 1e-9)}
        if not worse:
            return anchors
        anchors = {u: a for u, a in anchors.items() if schedule.placement.rank_of(u[0]) not in worse}
    return {}


def _lower(schedule: Schedule, costs: Costs, pairs, anchors) -> Program:
    lowering = Lowering.of(schedule, costs, recompute=pairs, recompute_at=anchors, vocab=False)
    return lowering.program(schedule)


def _place_rank(ops, plain_events, table, limit: float, policies) -> Anchors:
    """One rank's anchors (see the module docstring, steps 1 and 2)."""
    compute = [op for op in ops if type(op) in (Action, Recompute)]
    index = {op: i for i, op in enumerate(compute) if type(op) is Action}
    # activation held before each compute op, and what the op adds at its start (program order)
    level, allocs, held = [], [], 0.0
    recomputed = {op.unit for op in compute if type(op) is Recompute}
    for op in compute:
        if type(op) is Recompute:
            alloc, release = table.recomputed_share(op.stage, op.seq_chunk or 0), 0.0
        else:
            alloc, release = table.memory(op.kind, op.stage, op.seq_chunk or 0)
            if op.kind is Kind.F and op.unit in recomputed:
                alloc -= table.recomputed_share(op.stage, op.seq_chunk or 0)
        level.append(held)
        allocs.append(alloc)
        held += alloc + release
    extra = [0.0] * (len(compute) + 1)  # what moved recomputations add, as a difference array
    # the waits of the Program without recomputation: (start, room left, the action that waited)
    waits, ends = [], {}
    previous = None
    for event in plain_events:
        action = event.action
        if type(action) is Action:
            if previous is not None and event.start - previous > _EPS:
                waits.append([previous, event.start - previous, action])
            if action.kind is Kind.F:
                ends.setdefault(action.unit, event.end)
        previous = event.end
    anchors: Anchors = {}
    for position, op in enumerate(compute):
        if type(op) is not Recompute or (policies is not None and policies[op.stage].regathers):
            continue
        unit, need = op.unit, table.duration(Kind.F, op.stage, op.seq_chunk or 0)
        share = table.recomputed_share(op.stage, op.seq_chunk or 0)
        backward = next(a for a in compute[position + 1:] if type(a) is Action and a.unit == unit)
        chosen = None
        for wait in reversed(waits):
            start, room, anchor = wait
            if start < ends.get(unit, float("inf")) - _EPS or index[anchor] > index[backward]:
                continue
            if room + _EPS < need:
                continue
            if anchor == backward:
                chosen = wait  # its own wait holds it: where it is already
                break
            if _fits(level, allocs, extra, index[anchor], position, share, limit):
                chosen = wait
                break
        if chosen is None:
            continue
        chosen[1] -= need
        if chosen[2] != backward:
            anchors[unit] = chosen[2]
            extra[index[chosen[2]]] += share
            extra[position] -= share
    return anchors


def _fits(level, allocs, extra, start: int, stop: int, share: float, limit: float) -> bool:
    """Whether holding `share` more over compute ops [start, stop) keeps each within `limit`."""
    moved = sum(extra[:start])
    for k in range(start, stop):
        moved += extra[k]
        if level[k] + moved + allocs[k] + share > limit * (1 + 1e-9):
            return False
    return True
