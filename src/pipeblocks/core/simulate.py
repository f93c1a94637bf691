"""Event simulation of a Program under a cost model.

Each rank runs its ops in order. A compute op starts when the rank is free; a receive
completes when its send has run plus t_comm (so the consumer waits); a send costs the
sender nothing (it is posted asynchronously, as the runtime does). Activation memory is
allocated at the start of F and released at the end of the freeing pass.

The loop visits every op once: a rank runs until it meets a receive whose send has not
happened yet, parks there, and is woken by that send.

Data-parallel ops (`DPOp`) run on a second, communication stream per rank, in program
order: each is issued when the compute stream reaches it (the end of the compute action
before it) and starts when the stream is free; its duration is the link model's
(`dp_model`). The first pass of a stage after its UNSHARD waits for the gather; the end of
the step waits for every REDUCE_GRAD, then runs the zero1/zero2 parameter gather. The
compute stream's waits are the rank's exposed communication. Point-to-point transfers keep
their own model (t_comm after the send) and do not occupy the DP stream.

An optimizer step (`OptimizerStep`, asynchronous programs) occupies the compute stream for
its cost `t_step` and shows in the timeline as an event of its own.

A `Recompute` op (`recompute.add_recompute`) runs on the compute stream for its stage's
forward time; the forward it re-runs allocates only the kept input
(`Costs.recompute_input_ratio` of M_B) and the recomputation allocates the rest, which
the backward frees as usual.
"""
from __future__ import annotations

from collections.abc import Callable

from .actions import Action, Kind
from .collector import collector_paused
from .errors import DeadlockError
from .lower import check_deadlock
from .lowering import lower_for
from .ops import ACTION, DP, P2P, RECOMPUTE, STEP, unsupported
from .program import Comm, DPOp, OptimizerStep, Program, Recompute
from .schedule import Schedule
from .validate import check_structure
from .costs import Costs, StageCosts
from .timeline import CommEvent, Event, Timeline

__all__ = ["simulate", "simulate_program"]


def simulate(schedule: Schedule, costs: Costs | None = None, *, recompute=()) -> Timeline:
    """Validate, lower and simulate a schedule (a deadlock is found by the simulation itself).
    The costs' data-parallel side decides which DP passes lowering runs. `recompute`:
    (stage, microbatch) pairs whose forward is recomputed before the backward
    (`recompute.add_recompute`); none given, a schedule whose options say recompute="all"
    (`1f1b-r`) recomputes every pair (`lowering.lower_for` decides both)."""
    costs = costs or Costs()
    data_parallel = costs.data_parallel
    with collector_paused():
        check_structure(schedule)

        def lowered() -> Program:
            return lower_for(schedule, policies=data_parallel.sharding, dp=data_parallel.dp, recompute=recompute)

        compiled = _compile_program(lowered(), costs)
        # the compiled lists hold all the loop needs: the ops (a transfer object per send and
        # per receive) are freed before the events are made; a deadlock lowers again to name it
        return _run(compiled, lowered)


def simulate_program(program: Program, costs: Costs | None = None) -> Timeline:
    return _run(_compile_program(program, costs), lambda: program)


def _compile_program(program: Program, costs: Costs | None):
    """The schedule, the cost table, and per rank `_compile`'s lists and DP plan."""
    schedule = program.schedule
    table = (costs or Costs()).for_schedule(schedule)
    compiled, comm_plans = [], []
    for ops in program.ranks:
        steps, plan = _compile(ops, table, schedule)
        compiled.append(steps)
        comm_plans.append(plan)
    return schedule, table, compiled, comm_plans


def _run(compiled_program, program_of: Callable[[], Program]) -> Timeline:
    """The event loop over `_compile_program`'s result; `program_of` gives the Program
    again, only to name a deadlock."""
    schedule, table, compiled, comm_plans = compiled_program
    t_comm = table.t_comm
    p = len(compiled)
    lengths = [len(c[0]) for c in compiled]
    cursor = [0] * p
    clock = [0.0] * p
    mem = [0.0] * p
    peak = [0.0] * p
    events: list[list[Event]] = [[] for _ in range(p)]
    traces: list[list[tuple[float, float]]] = [[(0.0, 0.0)] for _ in range(p)]
    # a transfer's arrival time, from its send until its one receive reads (and drops) it
    arrival: dict[int, float] = {}
    parked: dict[int, int] = {}
    ready = list(range(p))
    streams = [_CommStream(plan, events[r]) for r, plan in enumerate(comm_plans)]
    new_event = tuple.__new__  # Event(...) without the Python-level NamedTuple __new__: hot loop
    while ready:
        r = ready.pop()
        receives, actions, durations, allocs, releases, sends, gates = compiled[r]
        pos, now, held, top = cursor[r], clock[r], mem[r], peak[r]
        evs, trace = events[r], traces[r]
        n = lengths[r]
        while pos < n:
            key = receives[pos]
            if key is not None:
                if type(key) is int:
                    t = arrival.pop(key, None)
                    if t is None:
                        parked[key] = r
                        break
                    if t > now:
                        now = t
                else:  # several receives before one action
                    missing = next((k for k in key if k not in arrival), None)
                    if missing is not None:
                        parked[missing] = r
                        break
                    for k in key:
                        t = arrival.pop(k)
                        if t > now:
                            now = t
            gate = gates[pos]
            if gate is not None:
                now = streams[r].wait(gate, now)
            end = now + durations[pos]
            evs.append(new_event(Event, (actions[pos], now, end)))
            alloc = allocs[pos]
            if alloc:
                held += alloc
                trace.append((now, held))
                if held > top:
                    top = held
            release = releases[pos]
            if release:
                held += release
                trace.append((end, held))
            now = end
            key = sends[pos]
            if key is not None:
                for k in (key,) if type(key) is int else key:
                    arrival[k] = now + t_comm
                    woken = parked.pop(k, None)
                    if woken is not None:
                        ready.append(woken)
            pos += 1
        cursor[r], clock[r], mem[r], peak[r] = pos, now, held, top
    compiled.clear()  # seven lists per rank, no longer needed: not alive beside the Timeline's tuples
    if any(cursor[r] < lengths[r] for r in range(p)):
        check_deadlock(program_of())  # raises with the blocked ranks named
        raise DeadlockError(f"schedule {schedule.name!r} did not finish in simulation")
    placement = schedule.placement
    static = tuple(
        table.data_parallel.static_memory(table.params, placement.stages_of(r)) for r in range(p)
    )
    split = table.data_parallel.bytes.gathered != table.data_parallel.bytes.grad and schedule.has_split_backward
    static_peak = tuple(
        table.data_parallel.static_memory(table.params, placement.stages_of(r), peak=True, split_backward=split)
        for r in range(p)
    )
    if not any(comm_plans):
        return Timeline(
            schedule=schedule,
            events=tuple(tuple(e) for e in events),
            memory=tuple(tuple(t) for t in traces),
            peak_activation=tuple(peak),
            static_memory=static,
            static_memory_peak=static_peak,
        )
    step_end = tuple(
        stream.finish(_after_step(table, placement.stages_of(r))) for r, stream in enumerate(streams)
    )
    return Timeline(
        schedule=schedule,
        events=tuple(tuple(e) for e in events),
        memory=tuple(tuple(t) for t in traces),
        peak_activation=tuple(peak),
        comm_events=tuple(tuple(stream.events) for stream in streams),
        exposed_comm=tuple(stream.exposed for stream in streams),
        step_end=step_end,
        static_memory=static,
        static_memory_peak=static_peak,
    )


def _after_step(table: StageCosts, stages) -> list[tuple[str, float]]:
    """The parameter gathers after the optimizer step (zero1, zero2), in stage order."""
    dp = table.data_parallel
    policies = dp.policies(len(table.params))
    out = []
    for s in stages:
        duration = dp.after_step_time(table.params[s], policies[s])
        if duration:
            out.append((f"{s}OPTIMIZER_GATHER", duration))
    return out


class _CommStream:
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
            before, text, duration = self.plan[self.pos]
            issued = compute[before - 1].end if before else 0.0
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


def _compile(ops, table, schedule: Schedule) -> tuple[tuple[list, ...], list[tuple[int, str, float]]]:
    """Per compute op (action or optimizer step), in seven parallel lists (a few pointers per action, not a tuple
    and lists each): the receive key(s) before it, the action, its duration, the memory
    allocated at its start, the memory released at its end, the send key(s) after it
    (None, one int, or a tuple of ints), and its gate. A send belongs to the action before
    it, a receive to the action after it. A key is `Comm.key` as one int:
    ((microbatch * k + chunk) * S + producing stage) * 2 + (1 for a gradient). `gate` is
    None, or the index in the DP plan of the gather the action waits for (the first pass
    of a stage after its UNSHARD). The plan: per DP collective, (index of the compute
    action it is issued before, its text, its duration)."""
    stages, chunks = schedule.num_stages, schedule.seq_chunks
    receives: list = []
    actions: list = []
    durations: list = []
    allocs: list = []
    releases: list = []
    sends: list = []
    gates: list = []
    cost_of: dict[tuple, tuple[float, float, float]] = {}
    waiting = None  # receive key(s) for the next action
    plan: list[tuple[int, str, float]] = []
    pending: dict[int, int] = {}  # stage -> plan index of its UNSHARD, until its first pass
    policies = None
    # which forwards keep only their input: a set-of-types test first, so a program
    # without recomputation pays no Python-level scan
    recomputed = {op.unit for op in ops if type(op) is Recompute} if Recompute in set(map(type, ops)) else None
    for op in ops:
        kind = type(op)
        if kind is Comm:
            payload, send, stage, mb, chunk, _peer = op
            grad = payload != "F"
            producer = stage if send else (stage + 1 if grad else stage - 1)
            key = ((mb * chunks + (chunk or 0)) * stages + producer) * 2 + grad
            if send:
                before = sends[-1]
                sends[-1] = key if before is None else (*((before,) if type(before) is int else before), key)
            else:
                waiting = key if waiting is None else (*((waiting,) if type(waiting) is int else waiting), key)
        elif kind is Action:
            ckey = (op.kind, op.stage, op.seq_chunk or 0)
            if recomputed and op.kind is Kind.F and op.unit in recomputed:
                ckey = ("kept", op.stage, ckey[2])
                cost = cost_of.get(ckey)
                if cost is None:
                    full = table.memory(Kind.F, op.stage, ckey[2])[0]
                    cost = cost_of[ckey] = (
                        table.duration(Kind.F, op.stage, ckey[2]), full - table.recomputed_share(op.stage, ckey[2]), 0.0
                    )
            else:
                cost = cost_of.get(ckey)
            if cost is None:
                cost = cost_of[ckey] = (table.duration(*ckey), *table.memory(*ckey))
            receives.append(waiting)
            waiting = None
            actions.append(op)
            durations.append(cost[0])
            allocs.append(cost[1])
            releases.append(cost[2])
            sends.append(None)
            gates.append(pending.pop(op.stage, None) if pending else None)
        elif kind is OptimizerStep:  # compute stream, no activation memory
            receives.append(waiting)
            waiting = None
            actions.append(op)
            durations.append(table.step[op.stage])
            allocs.append(0.0)
            releases.append(0.0)
            sends.append(None)
            gates.append(None)
        elif kind is Recompute:  # compute stream: the forward's time, the rest of its activation
            chunk = op.seq_chunk or 0
            receives.append(waiting)
            waiting = None
            actions.append(op)
            durations.append(table.duration(Kind.F, op.stage, chunk))
            allocs.append(table.recomputed_share(op.stage, chunk))
            releases.append(0.0)
            sends.append(None)
            gates.append(pending.pop(op.stage, None) if pending else None)
        elif kind is DPOp:
            if op.kind == "RESHARD":
                continue  # frees memory only: nothing on the link
            dp = table.data_parallel
            if policies is None:
                policies = dp.policies(len(table.params))
            if op.kind == "UNSHARD":
                pending[op.stage] = len(plan)
            plan.append((len(actions), str(op), dp.op_time(op.kind, table.params[op.stage], policies[op.stage])))
        else:
            raise unsupported(op, "the simulator", (ACTION, P2P, DP, STEP, RECOMPUTE))
    return (receives, actions, durations, allocs, releases, sends, gates), plan
