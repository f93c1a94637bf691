"""Event simulation of a Program under a cost model.

Each rank runs its ops in order. A compute op starts when the rank is free; a receive
completes when its send has run plus t_comm (so the consumer waits); a send costs the
sender nothing (it is posted asynchronously, as the runtime does). Activation memory is
allocated at the start of F and released at the end of the freeing pass.

The loop visits every op once: a rank runs until it meets a receive whose send has not
happened yet, parks there, and is woken by that send.
"""
from __future__ import annotations

import contextlib
import gc

from .actions import Action
from .errors import DeadlockError
from .lower import check_deadlock, lower
from .ops import ACTION, P2P, unsupported
from .program import Comm, Program
from .schedule import Schedule
from .validate import check_structure
from .costs import Costs
from .timeline import Event, Timeline

__all__ = ["simulate", "simulate_program"]


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Validate, lower and simulate a schedule (a deadlock is found by the simulation itself)."""
    with _collector_paused():
        check_structure(schedule)
        return simulate_program(lower(schedule), costs)


@contextlib.contextmanager
def _collector_paused():
    """Simulation allocates hundreds of thousands of small tuples and makes no reference
    cycles; the cyclic collector, triggered by those allocations, would walk the caller's
    whole heap again and again (twice the run time after a large generator)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def simulate_program(program: Program, costs: Costs | None = None) -> Timeline:
    schedule = program.schedule
    table = (costs or Costs()).for_schedule(schedule)
    t_comm = table.t_comm
    compiled = [_compile(ops, table) for ops in program.ranks]
    p = len(compiled)
    cursor = [0] * p
    clock = [0.0] * p
    mem = [0.0] * p
    peak = [0.0] * p
    events: list[list[Event]] = [[] for _ in range(p)]
    traces: list[list[tuple[float, float]]] = [[(0.0, 0.0)] for _ in range(p)]
    arrival: dict[tuple, float] = {}
    parked: dict[tuple, int] = {}
    ready = list(range(p))
    new_event = tuple.__new__  # Event(...) without the Python-level NamedTuple __new__: hot loop
    while ready:
        r = ready.pop()
        steps = compiled[r]
        pos, now, held, top = cursor[r], clock[r], mem[r], peak[r]
        evs, trace = events[r], traces[r]
        n = len(steps)
        while pos < n:
            receives, action, duration, alloc, release, sends = steps[pos]
            if receives:
                blocked = False
                for key in receives:
                    t = arrival.get(key)
                    if t is None:
                        parked[key] = r
                        blocked = True
                        break
                    if t > now:
                        now = t
                if blocked:
                    break
            end = now + duration
            evs.append(new_event(Event, (action, now, end)))
            if alloc:
                held += alloc
                trace.append((now, held))
                if held > top:
                    top = held
            if release:
                held += release
                trace.append((end, held))
            now = end
            for key in sends:
                arrival[key] = now + t_comm
                woken = parked.pop(key, None)
                if woken is not None:
                    ready.append(woken)
            pos += 1
        cursor[r], clock[r], mem[r], peak[r] = pos, now, held, top
    if any(cursor[r] < len(compiled[r]) for r in range(p)):
        check_deadlock(program)  # raises with the blocked ranks named
        raise DeadlockError(f"schedule {schedule.name!r} did not finish in simulation")
    return Timeline(
        schedule=schedule,
        events=tuple(tuple(e) for e in events),
        memory=tuple(tuple(t) for t in traces),
        peak_activation=tuple(peak),
    )


def _compile(ops, table) -> list[tuple]:
    """One entry per compute action: (receive keys before it, action, duration, memory
    allocated at its start, memory released at its end, send keys after it). A send
    belongs to the action before it, a receive to the action after it. Keys are
    `Comm.key`, unpacked inline because this loop runs once per op of the program."""
    out: list[tuple] = []
    cost_of: dict[tuple, tuple[float, float, float]] = {}
    receives: list[tuple] = []
    sends: list[tuple] = []
    for op in ops:
        kind = type(op)
        if kind is Comm:
            payload, send, stage, mb, chunk, _peer = op
            if send:
                sends.append((payload, stage, mb, chunk or 0))
            else:
                receives.append((payload, stage - 1 if payload == "F" else stage + 1, mb, chunk or 0))
        elif kind is Action:
            key = (op.kind, op.stage, op.seq_chunk or 0)
            cost = cost_of.get(key)
            if cost is None:
                cost = cost_of[key] = (table.duration(*key), *table.memory(*key))
            sends = []
            out.append((tuple(receives) if receives else (), op, cost[0], cost[1], cost[2], sends))
            receives.clear()
        else:
            raise unsupported(op, "the simulator", (ACTION, P2P))
    return out
