"""Inserting the vocabulary passes into any schedule (vocabulary parallelism).

The rule, the same for every schedule (Yeung et al., MLSys 2025, section 4): every rank
runs one S and one T per microbatch at aligned positions, after the last stage's forward
of that microbatch and before its backward; IF runs one forward ahead of stage 0's
forward, IB after stage 0's backward. "Aligned" is read off the schedule's own timeline
under the given costs: each rank runs a vocabulary pass at its first action boundary after
the pass's input is ready (X broadcast, the embedding gradient broadcast), T(i) and IB(i)
with the next microbatch's pass (the paper fuses T(i) with S(i+1): the collective they
wait for then has a microbatch's time to arrive), and all ranks hold the passes in one
order (sorted by that ready time), so the all-reduces line up and no rank idles at a pass.
A pass never goes after an op of its rank that (through any rank's transfers) follows what
waits for it: S(i) comes before whatever follows the last stage's backward of i, IF(i)
before whatever follows stage 0's forward of i, so the Program cannot deadlock on them. The timeline of the Program
with the passes is used to place them again (a few rounds; the fastest is kept).

A schedule whose last stage runs its backward right after its forward (1F1B) would wait
at every microbatch for the slowest rank to reach S. `one_more_in_flight` moves every
backward after the next forward of its rank, so each rank holds one more microbatch
(1F1B then warms up with p - r forwards: the paper's p + 1 activations on rank 0);
`add_vocab` tries the schedule with and without it and keeps the faster::

    1f1b p=2 m=3               0: 0F0 0F1 0BW0 0F2 0BW1 0BW2
    one_more_in_flight         0: 0F0 0F1 0F2 0BW0 0BW1 0BW2
                               1: 1F0 1F1 1BW0 1F2 1BW1 1BW2
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..ir.actions import Action, Kind
from ..ir.errors import DeadlockError, ScheduleError
from ..ir.ops import Comm, Overlap, spliced
from ..ir.program import Program
from ..ir.schedule import Schedule
from ..ir.vocab import VOCAB_KINDS, VocabPass, check_vocab, roots

__all__ = ["one_more_in_flight", "add_vocab", "place", "ROUNDS"]

ROUNDS = 3
_ORDER = {k: n for n, k in enumerate(VOCAB_KINDS)}


def one_more_in_flight(schedule: Schedule) -> Schedule:
    """Every backward (B or BW, with the W of its unit that follows before the next
    forward) moved after the next forward on its rank."""
    ranks = []
    for actions in schedule.ranks:
        out: list[Action] = []
        held: list[Action] = []
        units: set[tuple[int, int, int]] = set()
        for a in actions:
            if a.kind is Kind.F:
                out.append(a)
                out.extend(held)
                held.clear()
                units.clear()
            elif a.kind in (Kind.B, Kind.BW) or (a.kind is Kind.W and a.unit in units):
                held.append(a)
                units.add(a.unit)
            else:
                out.append(a)
        out.extend(held)
        ranks.append(tuple(out))
    return dataclasses.replace(schedule, ranks=tuple(ranks))


def place(program: Program, events, vocab, barriers: int = 1) -> Program:
    """Insert IF, S, T and IB of every microbatch into `program` (which holds none) at the
    boundaries the timeline `events` (per rank, the compute ops' events of this Program
    or of the same Program with vocabulary passes) makes ready, in one order on every rank."""
    ready = _ready_times(program.schedule, events, vocab)
    order = sorted(ready, key=lambda k: (ready[k], k[1], _ORDER[k[0]]))
    first_rank, last_rank = roots(program.schedule)
    follows = _follows(program, first_rank, last_rank)
    ranks = []
    for rank, ops in enumerate(program.ranks):
        at = _positions(rank, ops, events[rank], order, ready, vocab, (first_rank, last_rank))
        _clamp(at, order, _floors(rank, ops, program.schedule.num_stages - 1, first_rank, last_rank),
               _limits(ops, follows[rank], barriers), len(ops))
        slots: dict[int, list[VocabPass]] = {}
        for key in order:
            slots.setdefault(at[key], []).append(VocabPass(*key))
        ranks.append(spliced(ops, slots))
    return Program(program.schedule, tuple(ranks))


def _ready_times(schedule: Schedule, events, vocab) -> dict[tuple[str, int], float]:
    """When each vocabulary pass (kind, microbatch) is ready, read off the timeline `events`."""
    m, last = schedule.m, schedule.num_stages - 1
    # times of the passes that make each vocabulary pass ready
    f_end: dict[tuple[int, int], float] = {}
    f_start: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    s_end: dict[int, float] = {}
    for evs in events:
        for ev in evs:
            op = ev.action
            if type(op) is Action:
                if op.kind is Kind.F:
                    f_end[op.stage, op.microbatch] = ev.end
                    f_start[op.stage, op.microbatch] = ev.start
                elif op.kind in (Kind.B, Kind.BW):
                    b_end[op.stage, op.microbatch] = ev.end
            elif type(op) is VocabPass and op.kind == "S":
                s_end[op.microbatch] = max(s_end.get(op.microbatch, 0.0), ev.end)
    ready: dict[tuple[str, int], float] = {}
    if len(f_end) != schedule.num_stages * m:
        raise ScheduleError(f"schedule {schedule.name!r}: the vocabulary passes need one forward of every stage and "
                            f"microbatch, the timeline has {len(f_end)} of {schedule.num_stages * m}")
    for i in range(m):
        ready["IF", i] = f_start[0, i - 1] if i > 0 else 0.0
        ready["S", i] = f_end[last, i] + vocab.t_bcast
        ready["IB", i] = b_end[0, i] + vocab.t_ib_bcast
    for i in range(m):
        # T(i) and IB(i) wait for a collective; nothing waits for them but the step's end, so
        # each goes with the next microbatch's pass (the paper fuses T(i) with S(i+1)): the
        # collective has a whole microbatch to arrive and no rank idles for it
        ready["T", i] = max(s_end.get(i, ready["S", i] + vocab.t_s) + vocab.t_c0,
                            ready["S", i + 1] if i + 1 < m else 0.0)
        if i + 1 < m:
            ready["IB", i] = max(ready["IB", i], ready["IB", i + 1])
    return ready


def _positions(rank: int, ops, events, order, ready, vocab, roots_: tuple[int, int]) -> dict[tuple[str, int], int]:
    """Per pass, the position in `ops` of rank `rank`'s first compute op that starts once
    the pass is ready (the root's own broadcast taken off), before the receives it waits on."""
    first_rank, last_rank = roots_
    # compute ops of this rank and their start times, in program order
    starts: list[tuple[int, float]] = []
    compute = iter(e for e in events if type(e.action) is Action)
    for pos, op in enumerate(ops):
        if type(op) is Action:
            starts.append((pos, next(compute).start))
    at: dict[tuple[str, int], int] = {}
    for key in order:
        kind, i = key
        t = ready[key]
        if kind == "S" and rank == last_rank:
            t -= vocab.t_bcast
        if kind == "IB" and rank == first_rank:
            t -= vocab.t_ib_bcast
        pos = next((pos for pos, start in starts if start >= t - 1e-12 * max(1.0, abs(t))), len(ops))
        at[key] = _before_receives(ops, pos)
    return at


def _limits(ops, follows: list[tuple[int, int]], barriers: int) -> dict[tuple[str, int], int]:
    """A pass goes before every op of its rank that (through any rank) comes after what
    waits for it: S(i) (and T(i) with two barriers) before whatever follows the last
    stage's backward of i, IF(i) before whatever follows stage 0's forward of i."""
    limits: dict[tuple[str, int], int] = {}
    seen_b = seen_f = -1
    for pos, (after_b, after_f) in enumerate(follows):
        for i in range(seen_b + 1, after_b + 1):
            limits["S", i] = _before_receives(ops, pos)
            if barriers == 2:
                limits["T", i] = limits["S", i]
        for i in range(seen_f + 1, after_f + 1):
            limits["IF", i] = _before_receives(ops, pos)
        seen_b, seen_f = max(seen_b, after_b), max(seen_f, after_f)
    return limits


def _floors(rank: int, ops, last: int, first_rank: int, last_rank: int) -> dict[tuple[str, int], int]:
    """A root runs S after its own last-stage forward, IB after its own stage-0 backward,
    even when that pass takes no time (stage 0's B, whose input needs no gradient)."""
    floors: dict[tuple[str, int], int] = {}
    for pos, op in enumerate(ops):
        if type(op) is not Action:
            continue
        if rank == last_rank and op.stage == last and op.kind is Kind.F:
            floors["S", op.microbatch] = pos + 1
        if rank == first_rank and op.stage == 0 and op.kind in (Kind.B, Kind.BW):
            floors["IB", op.microbatch] = pos + 1
    return floors


def _clamp(at: dict[tuple[str, int], int], order, floors, limits, end: int) -> None:
    """`at` raised to its floors and kept in `order`, then lowered to its limits: a pass
    brought forward brings every pass ordered before it."""
    bound = 0
    for key in order:
        at[key] = bound = max(at[key], floors.get(key, 0), bound)
    bound = end
    for key in reversed(order):
        bound = min(bound, limits.get(key, bound))
        at[key] = min(at[key], bound)
        bound = at[key]


def _follows(program: Program, first_rank: int, last_rank: int) -> list[list[tuple[int, int]]]:
    """Per rank and op position of `program` (no vocabulary pass in it): the largest i such
    that the op comes after (on its rank, or through transfers) the last stage's backward of
    microbatch i, and the largest i such that it comes after stage 0's forward of i (-1: none),
    the op itself included."""
    last = program.schedule.num_stages - 1
    ranks = program.ranks
    out: list[list[tuple[int, int]]] = [[] for _ in ranks]
    state = [(-1, -1)] * len(ranks)
    sent: dict[tuple, tuple[int, int]] = {}
    waiting: dict[tuple, int] = {}
    ready = list(range(len(ranks)))
    while ready:
        rank = ready.pop()
        ops = ranks[rank]
        b, f = state[rank]
        while len(out[rank]) < len(ops):
            op = ops[len(out[rank])]
            if type(op) is Comm:
                if op.send:
                    sent[op.key] = (b, f)
                    woken = waiting.pop(op.key, None)
                    if woken is not None:
                        ready.append(woken)
                elif op.key in sent:
                    rb, rf = sent[op.key]
                    b, f = max(b, rb), max(f, rf)
                else:
                    waiting[op.key] = rank
                    break
            elif type(op) is Action:
                if rank == last_rank and op.stage == last and op.kind in (Kind.B, Kind.BW):
                    b = max(b, op.microbatch)
                if rank == first_rank and op.stage == 0 and op.kind is Kind.F:
                    f = max(f, op.microbatch)
            out[rank].append((b, f))
        state[rank] = (b, f)
    if any(len(o) < len(ops) for o, ops in zip(out, ranks)):
        raise DeadlockError(f"schedule {program.schedule.name!r} deadlocks before its vocabulary passes are placed")
    return out


def _before_receives(ops, pos: int) -> int:
    """The position of the receives just before the action at `pos` (a pass goes before them)."""
    while pos > 0 and type(ops[pos - 1]) is Comm and not ops[pos - 1].send:
        pos -= 1
    return pos


def add_vocab(program: Program, costs, *, simulate: Callable[[Program, Any], Any], relower=None,
              rounds: int = ROUNDS) -> Program:
    """The vocabulary passes inserted into `program` (lowered from its schedule, holding
    no vocabulary pass), for `costs` (a `Costs` with `vocab` set): placed on the plain
    schedule's timeline and on `one_more_in_flight`'s (lowered by `relower`, as `program`
    was, and checked; none given: the plain schedule only), each placed again `rounds`
    times on the timeline of the result, and the Program that simulates fastest kept.
    `simulate`: as `entry.lower_for`'s."""
    vocab = costs.vocab
    if vocab is None:
        raise ScheduleError("add_vocab needs costs with vocab set (VocabCosts): the vocabulary passes' prices")
    schedule = program.schedule
    if schedule.seq_chunks != 1:
        raise ScheduleError(
            f"--vocab-parallel runs whole microbatches, but schedule {schedule.name!r} splits each into "
            f"{schedule.seq_chunks} sequence chunks: pick a schedule without sequence chunks"
        )
    paired = next((op for ops in program.ranks for op in ops if type(op) is Overlap), None)
    if paired is not None or schedule.option("bidirectional"):
        raise ScheduleError(
            f"--vocab-parallel: schedule {schedule.name!r} runs "
            + (f"overlapped forward-backward pairs ({paired})" if paired is not None else "microbatches from both ends")
            + ", into which the vocabulary passes are not placed yet: pick zb-v, v-half, 1f1b or another schedule"
        )
    plain = dataclasses.replace(costs, vocab=None)
    candidates = [program]
    shifted = one_more_in_flight(schedule)
    if relower is not None and shifted.ranks != schedule.ranks:
        try:
            candidates.append(relower(shifted))
        except (ScheduleError, DeadlockError):
            pass  # the schedule cannot hold one more microbatch: keep it as it is
    best, best_time = None, float("inf")
    for base in map(lambda c: _tagged(c, vocab.barriers), candidates):
        events = simulate(base, plain).events
        for _ in range(rounds):
            placed = place(base, events, vocab, vocab.barriers)
            try:
                check_vocab(placed, vocab.barriers)
                timeline = simulate(placed, costs)
            except (ScheduleError, DeadlockError):
                break  # a placement on a timeline that no longer fits: the rounds before it stand
            if best is None or timeline.makespan < best_time - 1e-12 * max(1.0, best_time):
                best, best_time = placed, timeline.makespan
            events = timeline.events
    if best is None:
        raise ScheduleError(
            f"could not place the vocabulary passes into schedule {schedule.name!r} (p={schedule.p}, "
            f"m={schedule.m}) without a deadlock: run it without --vocab-parallel"
        )
    return best


def _tagged(program: Program, barriers: int) -> Program:
    """`program` whose schedule records the barriers (`vocab_links.barriers_of`)."""
    schedule = program.schedule
    options = tuple(o for o in schedule.options if o[0] != "vocab_barriers") + (("vocab_barriers", barriers),)
    return Program(dataclasses.replace(schedule, options=options), program.ranks)
