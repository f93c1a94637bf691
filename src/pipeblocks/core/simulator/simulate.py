"""Event simulation of a Program under a cost model.

Each rank runs its ops in order. A compute op starts when the rank is free; a receive
completes when its send has run plus t_comm (so the consumer waits); a send costs the
sender nothing (it is posted asynchronously, as the runtime does). Activation memory is
allocated at the start of F and released at the end of the freeing pass.

The loop visits every op once: a rank runs until it meets a receive whose send has not
happened yet, parks there, and is woken by that send.

Data-parallel ops (`DPOp`) run on a second, communication stream per rank (`dp_stream`:
when each is issued and starts, where the compute stream waits for one, which is the rank's
exposed communication, and how a pass at block grain meets them). Point-to-point transfers
keep their own model (t_comm after the send) and do not occupy the DP stream.

An optimizer step (`OptimizerStep`, asynchronous programs) occupies the compute stream for
its cost `t_step` and shows in the timeline as an event of its own.

Memory over time, for chunks that free their parameters between visits
(`zero3-regather`): the gathered parameter bytes of such a chunk are traced per rank (an
UNSHARD adds its unit's gathered bytes when the compute stream reaches it, a RESHARD takes
them away there), beside the activations, in program order; `Timeline.memory_peak` is then
the largest sum of the two on the rank, plus the rest of its static memory at the step's
peak (`dp_model.static_peak_bytes`, every other chunk gathered for the whole step, the
accumulated gradients held: FSDP2 keeps them across a reshard). A rank with no such chunk
keeps the conservative figure, static memory at the step's peak plus peak activation, and
`memory_peak` is left empty when no rank has one (`Timeline.memory_need`).

An overlapped forward-backward pair (`Overlap`) occupies the compute stream for
`StageCosts.pair_duration` (its parts, less what the declared overlap hides) and starts
once both parts' inputs have arrived; its forward allocates at its start and its backward
frees at its end, so while it runs the rank holds one more activation than after it. The
timeline shows its two parts one after the other, sharing its time as their durations do.

A `Recompute` op (`recompute.add_recompute`) runs on the compute stream for its stage's
forward time; the forward it re-runs allocates only the kept input
(`Costs.recompute_input_ratio` of M_B) and the recomputation allocates the rest, which
the backward frees as usual.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..ir.actions import Action, Kind
from .collector import collector_paused
from ..ir.errors import DeadlockError
from ..lowering.lower import check_deadlock
from ..lowering.entry import lower_for
from ..ir.ops import ACTION, DP, OVERLAP, P2P, RECOMPUTE, STEP, Comm, DPOp, OptimizerStep, Overlap, Recompute, unsupported
from ..ir.program import Program
from ..ir.schedule import Schedule
from ..lowering.validate import check_structure
from ..cost.costs import Costs
from ..cost.dp_model import gathered_bytes
from .dp_stream import CommStream, UnitPasses, after_step_gathers
from .timeline import Event, Timeline
from ..ir.errors import ScheduleError
from ..ir.vocab import VocabPass
from .vocab_sim import vocab_keys, vocab_reduce, vocab_sends as _vocab_sends, vocab_static

__all__ = ["simulate", "simulate_lowered", "simulate_program"]


def simulate(schedule: Schedule, costs: Costs | None = None, *, recompute=(), recompute_at=None) -> Timeline:
    """Validate, lower and simulate a schedule (a deadlock is found by the simulation itself).
    The costs' data-parallel side decides which DP passes lowering runs. `recompute`:
    (stage, microbatch) pairs whose forward is recomputed before the backward
    (`recompute.add_recompute`); none given, a schedule whose options say recompute="all"
    (`1f1b-r`) recomputes every pair (`lowering.lower_for` decides both). `recompute_at`:
    where a unit's recomputation runs when earlier than its backward (`resolve.recompute_place`).
    With recomputation the timeline also says which part of it lengthens the step
    (`Timeline.recompute_exposed`): the Program is simulated a second time without it.
    A resolved run is simulated with its own Program (`resolve.program.simulate_run`)."""
    costs = costs or Costs()
    data_parallel = costs.data_parallel

    def lowered() -> Program:
        return lower_for(schedule, policies=data_parallel.sharding, dp=data_parallel.dp, recompute=recompute,
                         recompute_at=recompute_at, units=costs.dp_units(schedule.num_stages),
                         vocab=costs if costs.vocab is not None else None, simulate=simulate_program)

    return simulate_lowered(schedule, lowered, costs)


def simulate_lowered(schedule: Schedule, lowered: Callable[[], Program], costs: Costs | None = None) -> Timeline:
    """Validate `schedule` and simulate the Program `lowered()` gives for it (`simulate_program`).
    Without recomputation the compiled lists hold all the loop needs: the ops (a transfer
    object per send and per receive) are freed before the events are made, and a deadlock
    lowers again (`lowered()`) to name it."""
    with collector_paused():
        check_structure(schedule)
        program = lowered()
        if _recomputes(program):
            return simulate_program(program, costs)
        compiled = _compile_program(program, costs)
        del program
        return _run(compiled, lowered)


def simulate_program(program: Program, costs: Costs | None = None) -> Timeline:
    """Simulate a lowered Program; one that recomputes is also simulated without its RECOMPUTE
    ops, to tell the part of the recomputation that lengthens the step."""
    timeline = _run(_compile_program(program, costs), lambda: program)
    if not _recomputes(program):
        return timeline
    plain = Program(program.schedule, tuple(tuple(op for op in ops if type(op) is not Recompute)
                                             for ops in program.ranks))
    without = _run(_compile_program(plain, costs), lambda: plain)
    tiny = 1e-12 * max(timeline.makespan, 1.0)  # sums of the same durations in another order: rounding, not time

    def later(a: float, b: float) -> float:
        return a - b if a - b > tiny else 0.0

    exposed = tuple(later(timeline.rank_end(r), without.rank_end(r)) for r in range(len(timeline.events)))
    return dataclasses.replace(timeline, recompute_exposed=exposed,
                               recompute_step_cost=later(timeline.makespan, without.makespan))


def _recomputes(program: Program) -> bool:
    return any(Recompute in set(map(type, ops)) for ops in program.ranks)  # C-level scans: no Python loop per op


def _compile_program(program: Program, costs: Costs | None):
    """The schedule, the cost table, and per rank `simulate._compile`'s lists and DP plan."""
    schedule = program.schedule
    table = (costs or Costs()).for_schedule(schedule)
    compiled, comm_plans, gathered = [], [], []
    vocab = vocab_keys(program, table)  # None without vocabulary passes
    for r, ops in enumerate(program.ranks):
        steps, plan, held = _compile(ops, table, schedule, None if vocab is None else (vocab[0][r], vocab[1]))
        compiled.append(steps)
        comm_plans.append(plan)
        gathered.append(held)
    return schedule, table, compiled, comm_plans, gathered, (vocab[2] if vocab is not None else {})


def _run(compiled_program, program_of: Callable[[], Program]) -> Timeline:
    """The event loop over `_compile_program`'s result; `program_of` gives the Program
    again, only to name a deadlock."""
    schedule, table, compiled, comm_plans, gathered, delays = compiled_program
    p = len(compiled)
    events: list[list[Event]] = [[] for _ in range(p)]
    streams = [CommStream(plan, events[r]) for r, plan in enumerate(comm_plans)]
    traces, peak, unfinished = _event_loop(compiled, table, streams, events, delays)
    # the parameters a regathering chunk holds, beside the activations, before the lists go
    crests = [_crest(compiled[r][3], compiled[r][4], gathered[r]) if gathered[r] else None for r in range(p)]
    compiled.clear()  # seven lists per rank, no longer needed: not alive beside the Timeline's tuples
    if unfinished:
        check_deadlock(program_of())  # raises with the blocked ranks named
        raise DeadlockError(f"schedule {schedule.name!r} did not finish in simulation")
    placement = schedule.placement
    static, static_peak = _static_memory(table, schedule, p)
    parts = dict(
        schedule=schedule, events=tuple(tuple(e) for e in events), memory=tuple(tuple(t) for t in traces),
        peak_activation=tuple(peak), static_memory=static, static_memory_peak=static_peak,
        memory_peak=_memory_peak(table, placement, static_peak, peak, crests),
    )
    if not any(comm_plans):
        return Timeline(**parts)
    step_end = tuple(
        stream.finish(vocab_reduce(table) + after_step_gathers(table, placement.stages_of(r)))
        for r, stream in enumerate(streams)
    )
    return Timeline(**parts, comm_events=tuple(tuple(stream.events) for stream in streams),
                    exposed_comm=tuple(stream.exposed for stream in streams), step_end=step_end)


def _event_loop(compiled, table, streams, events, delays):
    """Run every rank's compiled lists until all finish or all wait: each rank's memory trace
    and peak activation, and whether a rank was left unfinished (a deadlock)."""
    t_comm = table.t_comm
    p = len(compiled)
    lengths = [len(c[0]) for c in compiled]
    cursor = [0] * p
    clock = [0.0] * p
    mem = [0.0] * p
    peak = [0.0] * p
    traces: list[list[tuple[float, float]]] = [[(0.0, 0.0)] for _ in range(p)]
    # a transfer's arrival time, from its send until its one receive reads (and drops) it
    arrival: dict[int, float] = {}
    parked: dict[int, int] = {}
    ready = list(range(p))
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
                else:
                    t = _all_received(key, arrival, parked, r)
                    if t is None:
                        break
                if t > now:
                    now = t
            gate = gates[pos]
            if gate is None:
                end = now + durations[pos]
            elif type(gate) is int:
                now = streams[r].wait(gate, now)
                end = now + durations[pos]
            else:  # a pass through units that meets the DP stream inside
                end = gate.run(streams[r], now)
                now = end - durations[pos]
            act = actions[pos]
            if type(act) is Overlap:  # two events, sharing the pair's time as their parts' durations
                f_part = table.duration(Kind.F, act.forward.stage)
                whole = f_part + table.duration(Kind.BW, act.backward.stage)
                mid = now + (end - now) * (f_part / whole if whole > 0 else 0.5)
                evs.append(new_event(Event, (act.forward, now, mid)))
                evs.append(new_event(Event, (act.backward, mid, end)))
            else:
                evs.append(new_event(Event, (act, now, end)))
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
                    arrival[k] = now + (t_comm if k >= 0 else delays[k])  # < 0: a vocabulary key
                    woken = parked.pop(k, None)
                    if woken is not None:
                        ready.append(woken)
            pos += 1
        cursor[r], clock[r], mem[r], peak[r] = pos, now, held, top
    return traces, peak, any(cursor[r] < lengths[r] for r in range(p))


def _all_received(key: tuple[int, ...], arrival: dict[int, float], parked: dict[int, int], r: int) -> float | None:
    """When the several receives `key` before rank `r`'s next action have all arrived (each
    read and dropped), or None with the rank parked on the first still missing."""
    missing = next((k for k in key if k not in arrival), None)
    if missing is not None:
        parked[missing] = r
        return None
    return max(arrival.pop(k) for k in key)


def _static_memory(table, schedule: Schedule, p: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per rank, static memory between steps and at the step's peak (with the vocabulary rows)."""
    dp, placement = table.data_parallel, schedule.placement
    static = tuple(dp.static_memory(table.params, placement.stages_of(r)) for r in range(p))
    split = dp.bytes.gathered != dp.bytes.grad and schedule.has_split_backward
    static_peak = tuple(
        dp.static_memory(table.params, placement.stages_of(r), peak=True, split_backward=split) for r in range(p)
    )
    if table.vocab is not None:  # every rank holds V/p rows of the embedding and the head
        static, static_peak = (tuple(x + vocab_static(table, peak) for x in values)
                               for peak, values in ((False, static), (True, static_peak)))
    return static, static_peak


def _memory_peak(table, placement, static_peak, peak, crests) -> tuple[float, ...]:
    """Per rank, the peak of static memory plus activations and regathered parameters, when a
    rank has a regathering chunk (`_crest`); else empty."""
    if all(c is None for c in crests):
        return ()
    dp = table.data_parallel
    policies = dp.policies(len(table.params))
    return tuple(
        static_peak[r] + peak[r] if crests[r] is None
        else static_peak[r] + crests[r]
        - sum(gathered_bytes(table.params[s], policies[s], dp.bytes)
              for s in placement.stages_of(r) if policies[s].regathers)  # the chunks freed between visits
        for r in range(len(crests))
    )


def _crest(allocs: list[float], releases: list[float], held: list[tuple[int, float]]) -> float:
    """The largest activation plus regathered-parameter bytes a rank holds, walking its
    compute ops in order: `held` is (index of the compute op it comes before, bytes
    gathered (+) or freed (-)), in program order; a pass allocates at its start and
    releases at its end, as the event loop counts them."""
    top = total = 0.0
    k, n = 0, len(held)
    for i, (alloc, release) in enumerate(zip(allocs, releases)):
        while k < n and held[k][0] == i:
            total += held[k][1]
            top = max(top, total)
            k += 1
        total += alloc
        top = max(top, total)
        total += release
    while k < n:
        total += held[k][1]
        top = max(top, total)
        k += 1
    return top


def _compile(ops, table, schedule: Schedule, vocab=None) -> tuple[tuple[list, ...], list, list[tuple[int, float]]]:
    """Per compute op (action or optimizer step), in seven parallel lists (a few pointers per action, not a tuple
    and lists each): the receive key(s) before it, the action, its duration, the memory
    allocated at its start, the memory released at its end, the send key(s) after it
    (None, one int, or a tuple of ints), and its gate. A send belongs to the action before
    it, a receive to the action after it. A key is `Comm.key` as one int:
    ((microbatch * k + chunk) * S + producing stage) * 2 + (1 for a gradient). `gate` is
    None, or the index in the DP plan of the gather the action waits for (the first pass
    of a stage after its UNSHARD), or a `UnitPass` for a pass through units that meets the
    DP stream inside (block grain). The plan: per DP collective, (index of the compute
    action it is issued before, its text, its duration, and None or the (`UnitPass`,
    boundary) inside a pass where it is issued). Last, for a chunk that frees its parameters
    between visits (zero3-regather), its UNSHARDs and RESHARDs as memory: (index of the
    compute action it comes before, gathered bytes added or freed)."""
    compiler = _RankCompiler(table, schedule, ops, vocab)
    handlers = {Comm: compiler.comm, Action: compiler.action, VocabPass: compiler.vocab_pass,
                Overlap: compiler.overlap, OptimizerStep: compiler.optimizer_step, Recompute: compiler.recompute,
                DPOp: compiler.dp_op}
    link_of = compiler.link_of
    for at, op in enumerate(ops):
        if link_of is not None and at in link_of:  # what a vocabulary pass, or an action it feeds, waits for
            for k in link_of[at][0]:
                compiler.waiting = _joined(compiler.waiting, compiler.vkeys[k])
        handler = handlers.get(type(op))
        if handler is None:
            raise unsupported(op, "the simulator", (ACTION, P2P, DP, STEP, RECOMPUTE, OVERLAP))
        handler(op, at)
    return compiler.lists, compiler.plan, compiler.held


def _joined(before, key: int):
    """`key` added to None, one key, or a tuple of keys."""
    return key if before is None else (*((before,) if type(before) is int else before), key)


class _RankCompiler:
    """`_compile`'s lists for one rank, filled op by op (one method per op type)."""

    def __init__(self, table, schedule: Schedule, ops, vocab) -> None:
        self.table, self.stages, self.chunks = table, schedule.num_stages, schedule.seq_chunks
        self.lists: tuple[list, ...] = ([], [], [], [], [], [], [])  # `_compile`'s seven, in its order
        self.receives, self.actions, self.durations, self.allocs, self.releases, self.sends, self.gates = self.lists
        self.cost_of: dict[tuple, tuple[float, float, float]] = {}
        self.waiting = None  # receive key(s) for the next action
        self.plan: list[tuple[int, str, float, tuple | None]] = []
        self.pending: dict[int, int] = {}  # stage -> plan index of its UNSHARD, until its first pass
        self.units = UnitPasses(table, schedule, self.gates) if table.units is not None else None
        self.policies = None
        self.held: list[tuple[int, float]] = []  # a regathering chunk's gathers (+) and frees (-)
        # which forwards keep only their input: a set-of-types test first, so a program
        # without recomputation pays no Python-level scan
        self.recomputed = ({op.unit for op in ops if type(op) is Recompute} if Recompute in set(map(type, ops))
                           else None)
        self.link_of, self.vkeys = vocab if vocab is not None else (None, None)

    def push(self, op, duration: float, alloc: float, release: float, gate=None) -> None:
        """A compute op, with the receives before it."""
        self.receives.append(self.waiting)
        self.waiting = None
        self.actions.append(op)
        self.durations.append(duration)
        self.allocs.append(alloc)
        self.releases.append(release)
        self.sends.append(None)
        self.gates.append(gate)

    def stage_gate(self, stage: int):
        return self.pending.pop(stage, None) if self.pending else None

    def comm(self, op: Comm, at: int) -> None:
        payload, send, stage, mb, chunk, _peer = op
        grad = payload != "F"
        producer = stage if send else (stage + 1 if grad else stage - 1)
        key = ((mb * self.chunks + (chunk or 0)) * self.stages + producer) * 2 + grad
        if send:
            self.sends[-1] = _joined(self.sends[-1], key)
        else:
            self.waiting = _joined(self.waiting, key)

    def action(self, op: Action, at: int) -> None:
        table, cost_of = self.table, self.cost_of
        ckey = (op.kind, op.stage, op.seq_chunk or 0)
        if self.recomputed and op.kind is Kind.F and op.unit in self.recomputed:
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
        self.push(op, cost[0], cost[1], cost[2], self.stage_gate(op.stage))
        if self.link_of is not None and at in self.link_of:
            _vocab_sends(self.sends, self.link_of[at][1], self.vkeys)
        if self.units is not None:
            self.units.on_pass(op, len(self.actions) - 1, cost[0], self.plan)

    def vocab_pass(self, op: VocabPass, at: int) -> None:  # compute stream; its collectives are keys (`vocab_links`)
        vocab = self.table.vocab
        if vocab is None:
            raise ScheduleError(f"the costs price no vocabulary pass ({op}): give Costs(vocab=VocabCosts(...))")
        self.push(op, vocab.duration(op.kind), vocab.mem_st if op.kind == "S" else 0.0,
                  -vocab.mem_st if op.kind == "T" else 0.0)
        if at in self.link_of:
            _vocab_sends(self.sends, self.link_of[at][1], self.vkeys)

    def overlap(self, op: Overlap, at: int) -> None:
        """One compute op: the forward allocates at its start, the backward frees at its end."""
        f, bw = op
        table, units = self.table, self.units
        if units is not None and any(st in units.gathers or st in units.anchored for st in (f.stage, bw.stage)):
            # a gather met inside the pair's time (block grain): not modelled
            raise unsupported(op, "the simulator's per-unit gathers (--dp-unit block)",
                              (ACTION, P2P, DP, STEP, RECOMPUTE))
        alloc = table.memory(Kind.F, f.stage)[0]
        if self.recomputed and f.unit in self.recomputed:
            alloc -= table.recomputed_share(f.stage)
        waits = [g for g in (self.stage_gate(f.stage), self.stage_gate(bw.stage)) if g is not None]
        gate = max(waits) if waits else None
        self.push(op, table.pair_duration(f.stage, bw.stage), alloc, table.memory(Kind.BW, bw.stage)[1], gate)

    def optimizer_step(self, op: OptimizerStep, at: int) -> None:  # compute stream, no activation memory
        self.push(op, self.table.step[op.stage], 0.0, 0.0)

    def recompute(self, op: Recompute, at: int) -> None:
        """Compute stream: the forward's time, the rest of its activation."""
        chunk = op.seq_chunk or 0
        duration = self.table.duration(Kind.F, op.stage, chunk)
        self.push(op, duration, self.table.recomputed_share(op.stage, chunk), 0.0, self.stage_gate(op.stage))
        if self.units is not None:
            self.units.on_pass(op, len(self.actions) - 1, duration, self.plan)

    def dp_op(self, op: DPOp, at: int) -> None:
        table = self.table
        dp = table.data_parallel
        if self.policies is None:
            self.policies = dp.policies(len(table.params))
        policy = self.policies[op.stage]
        if op.kind != "REDUCE_GRAD" and policy.regathers:
            size = table.unit_params(op.stage, op.unit) * dp.bytes.gathered
            self.held.append((len(self.actions), size if op.kind == "UNSHARD" else -size))
        if op.kind == "RESHARD":
            return  # frees memory only: nothing on the link
        duration = dp.op_time(op.kind, table.unit_params(op.stage, op.unit), policy)
        if op.unit is not None:
            if self.units is None:
                table.unit_params(op.stage, op.unit)  # raises: the costs have no units
            self.units.on_dp_op(op, len(self.actions), str(op), duration, self.plan)
            return
        if op.kind == "UNSHARD":
            self.pending[op.stage] = len(self.plan)
        self.plan.append((len(self.actions), str(op), duration, None))
