"""Our own cost-aware search, for any placement: a memory-safe list scheduler and a
bounded local search. Both only propose orders; `pick_best` in `_zb_timing` chooses.

List scheduler. Every rank keeps its Fs and its Bs in microbatch order per stage. At each
step the rank whose next pass can start earliest places it: a B or an F (by `prefer` on a
tie), or a pending W when that W fits entirely in the wait for the B/F, or when nothing
else can run. Memory: a microbatch may enter a rank (its first F there) only if the rank
can also hold it on all its later stages; so the oldest microbatch always advances and no
limit at or above the floor (`memory_floor`) deadlocks.

Weight refill. Keep each rank's F and B order from a finished schedule (a fixed pattern
built for equal costs) and place its Ws again under the real costs: a pending W runs when
it fits entirely in the wait for the next F or B, when memory requires it, or (with
`partial`) when the wait it would lengthen is within the worst rank's bubble so far; the
rest drain at the end. Ws are off the critical path, so this keeps the pattern's shape
and memory bound while its Ws stop delaying Bs when W is cheaper or dearer than F and B.

Local search. Adjacent swaps on each rank, the ranks with the longest spans first; a swap
is kept when it shortens (longest span, sum of spans) and stays valid and within memory.
`budget` bounds the replays, and so does the size: at most about 2 million replayed
actions in all (100 replays up to 20,000 actions), so the result is deterministic and a
large schedule's search takes bounded time.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

from ..core.ir.actions import Action, Kind
from ..core.ir.errors import ScheduleError
from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ..core.cost.costs import Costs, StageCosts
from ._reorder import peaks_of, replay_spans
from ._zb_timing import Timer, Unplaceable

__all__ = ["hill_climb", "list_schedule", "refill_weights", "refilled"]

F_, B_, W_ = Kind.F, Kind.B, Kind.W
_EPS = 1e-9
_SEARCH_WORK = 2_000_000  # local search replays at most about this many actions in all


def list_schedule(
    placement: Placement, m: int, table: StageCosts, limit: float, *, prefer: str = "B"
) -> tuple[tuple[Action, ...], ...]:
    """The list scheduler's order of `m` microbatches (module docstring)."""
    return _ListScheduler(placement, m, Timer(placement, table, limit), prefer).run()


class _ListScheduler:
    """One run of the list scheduler: the timer, and per stage the next F and B to place."""

    def __init__(self, placement: Placement, m: int, timer: Timer, prefer: str) -> None:
        self.placement, self.m, self.timer, self.prefer = placement, m, timer, prefer
        self.stages = [placement.stages_of(r) for r in range(placement.num_ranks)]
        self.next_f = {s: 0 for s in range(placement.num_stages)}
        self.next_b = dict(self.next_f)
        # per rank: microbatches with some but not all of the rank's forwards placed
        self.open_mbs: list[dict[int, int]] = [{} for _ in range(placement.num_ranks)]

    def run(self) -> tuple[tuple[Action, ...], ...]:
        # A rank's candidate depends on its own state and on the arrival of its inputs, so
        # only the placing rank and the rank consuming the placed pass need a new one.
        timer, p = self.timer, self.placement.num_ranks
        rank_of, last = self.placement.stage_to_rank, self.placement.num_stages - 1
        remaining = 2 * self.m * self.placement.num_stages
        cached = [self.candidate(rank) for rank in range(p)]
        while remaining:
            chosen = None
            for rank in range(p):
                c = cached[rank]
                if c is not None and (chosen is None or (c[0], c[1]) < (chosen[1][0], chosen[1][1])):
                    chosen = (rank, c)
            if chosen is None:
                raise Unplaceable("list scheduler stalled")
            rank, (_, is_w, kind, stage) = chosen
            if is_w:
                timer.put_w(rank)
                cached[rank] = self.candidate(rank)
                continue
            consumer = stage + 1 if kind is F_ else stage - 1
            if 0 <= consumer <= last:
                cached[rank_of[consumer]] = None  # recomputed below, after the placement
            self.place(rank, kind, stage)
            remaining -= 1
            cached[rank] = self.candidate(rank)
            if 0 <= consumer <= last:
                cached[rank_of[consumer]] = self.candidate(rank_of[consumer])
        timer.drain()
        return timer.ranks()

    def place(self, rank: int, kind: Kind, stage: int) -> None:
        """Place the next F or B of `stage` on `rank` (Ws first while an F does not fit)."""
        timer = self.timer
        if kind is F_:
            index = self.next_f[stage]
            while not timer.fits(F_, stage):
                timer.put_w(rank)
            timer.put(F_, stage, index)
            self.next_f[stage] += 1
            done = self.open_mbs[rank].get(index, 0) + 1
            if done == len(self.stages[rank]):
                self.open_mbs[rank].pop(index, None)
            else:
                self.open_mbs[rank][index] = done
        else:
            timer.put(B_, stage, self.next_b[stage])
            self.next_b[stage] += 1

    def f_allowed(self, rank: int, stage: int, mb: int) -> bool:
        if mb in self.open_mbs[rank]:
            return True  # reserved when the microbatch entered
        timer = self.timer
        entry = self.stages[rank].index(stage)
        need = sum(timer.delta(F_, s) for s in self.stages[rank][entry:])
        freeable = sum(-timer.delta(W_, s) for s, _ in timer.pending[rank])
        reserved = 0.0  # the later forwards of the microbatches already in
        for done in self.open_mbs[rank].values():
            reserved += sum(timer.delta(F_, s) for s in self.stages[rank][done:])
        return timer.mem[rank] + reserved + need - freeable <= timer.limit

    def candidate(self, rank: int):
        """(start, is_w, kind, stage) of the pass this rank would place next, or None."""
        timer, best = self.timer, None
        for s in self.stages[rank]:
            for kind, index in ((B_, self.next_b[s]), (F_, self.next_f[s])):
                if index >= self.m:
                    continue
                if kind is B_ and index >= self.next_f[s]:
                    continue
                ready = timer.arrival(kind, s, index)
                if ready is None or (kind is F_ and not self.f_allowed(rank, s, index)):
                    continue
                start = max(timer.clock[rank], ready)
                tie = (0 if kind.value == self.prefer else 1, -s)
                if best is None or (start, tie) < (best[0], best[3]):
                    best = (start, False, kind, tie, s)
        pending = timer.pending[rank]
        if pending:
            w_end = timer.clock[rank] + timer.cost(W_, pending[0][0])
            if best is None or w_end <= best[0] + _EPS:
                return (timer.clock[rank], True, W_, None)
        return None if best is None else (best[0], False, best[2], best[4])


def refill_weights(
    placement: Placement, ranks: Sequence[Sequence[Action]], table: StageCosts, limit: float, *, partial: bool = False
) -> tuple[tuple[Action, ...], ...]:
    """The F/B order of `ranks` with its Ws placed again under the costs (module docstring)."""
    timer = Timer(placement, table, limit)
    main = [[a for a in row if a.kind is not W_] for row in ranks]
    if any(a.kind is Kind.BW for row in main for a in row):
        raise ScheduleError("refill_weights needs a split backward (B and W); this schedule fuses them (BW)")
    cursor = [0] * len(main)
    heads: list[tuple[float, int]] = []  # (earliest start, rank) of each rank's next F/B whose input is placed
    waiting: dict[tuple[Kind, int, int], int] = {}  # producer pass -> rank whose next F/B needs it

    def offer(rank: int) -> None:
        if cursor[rank] >= len(main[rank]):
            return
        a = main[rank][cursor[rank]]
        ready = timer.arrival(a.kind, a.stage, a.microbatch)
        if ready is None or (a.kind is B_ and not timer.placed(F_, a.stage, a.microbatch)):
            # parked until the producing pass is placed (the local F of a B is placed first in order)
            waiting[_producer(a, timer.last)] = rank
            return
        heapq.heappush(heads, (max(ready, timer.clock[rank]), rank))

    for rank in range(len(main)):
        offer(rank)
    while heads:
        _, rank = heapq.heappop(heads)
        a = main[rank][cursor[rank]]
        ready = timer.arrival(a.kind, a.stage, a.microbatch)
        pending = timer.pending[rank]
        while pending and ready >= timer.clock[rank] + timer.cost(W_, pending[0][0]) - _EPS:
            timer.put_w(rank)
        wait = ready - timer.clock[rank]
        if partial and pending and wait > _EPS and wait > timer.max_bubble() - timer.bubble[rank]:
            timer.put_w(rank)
        while not timer.fits(a.kind, a.stage):
            timer.put_w(rank)  # Unplaceable when no W is left to free memory
        timer.put(a.kind, a.stage, a.microbatch)
        cursor[rank] += 1
        woken = waiting.pop((a.kind, a.stage, a.microbatch), None)
        if woken is not None:
            offer(woken)
        offer(rank)
    if any(cursor[r] < len(main[r]) for r in range(len(main))):
        raise Unplaceable("refill_weights: the F/B order deadlocks")
    timer.drain()
    return timer.ranks()


def refilled(
    placement: Placement, ranks: Sequence[Sequence[Action]], table: StageCosts, limit: float
) -> list[tuple[bool, tuple[tuple[Action, ...], ...]]]:
    """(partial, order) of `refill_weights` with partial False, then True, each that fits `limit`."""
    out = []
    for partial in (False, True):
        try:
            out.append((partial, refill_weights(placement, ranks, table, limit, partial=partial)))
        except Unplaceable:  # the F/B order needs more memory than the limit at some point
            continue
    return out


def _producer(a: Action, last: int) -> tuple[Kind, int, int]:
    """The pass whose end makes `a`'s cross-stage input available."""
    if a.kind is F_:
        return (F_, a.stage - 1, a.microbatch)
    return (B_, a.stage + 1, a.microbatch) if a.stage < last else (F_, a.stage, a.microbatch)


def _score(ranks, table: StageCosts, limit: float, m: int):
    """((longest span, sum of spans), spans) of a swapped order, or None when it cannot
    run (a swap that puts a pass before its own rank's input deadlocks the replay) or
    breaks the memory limit. Same numbers as the simulator, without lowering."""
    if max(peaks_of(ranks, table)) > limit + _EPS:
        return None
    replayed = replay_spans(ranks, table, m)
    if replayed is None:
        return None
    spans = replayed[1]
    return (round(max(spans), 9), round(sum(spans), 9)), spans


def hill_climb(schedule: Schedule, costs: Costs | None, limit: float, budget: int) -> Schedule:
    """First-improvement adjacent swaps under a simulation budget (see module docstring)."""
    table = (costs or Costs()).for_schedule(schedule)
    # replays cost time in proportion to the actions: bound the work, not only the count
    budget = min(budget, max(1, _SEARCH_WORK // max(1, sum(map(len, schedule.ranks)))))
    scored = _score(schedule.ranks, table, limit, schedule.m)
    if scored is None or budget <= 0:
        return schedule
    best_key, spans = scored
    ranks = [list(actions) for actions in schedule.ranks]
    used = 0
    improved = True
    while improved and used < budget:
        improved = False
        for rank in sorted(range(len(ranks)), key=lambda r: -spans[r]):
            actions = ranks[rank]
            for k in range(len(actions) - 1):
                a, b = actions[k], actions[k + 1]
                if a.unit == b.unit or a.kind is b.kind is W_:
                    continue  # same unit: order is forced; two Ws: no timing effect
                actions[k], actions[k + 1] = b, a
                used += 1
                result = _score(ranks, table, limit, schedule.m)
                if result is not None and result[0] < best_key:
                    best_key, spans = result
                    schedule = Schedule(schedule.name, schedule.p, schedule.m, schedule.placement,
                                        tuple(tuple(x) for x in ranks), options=schedule.options)
                    improved = True
                    break
                actions[k], actions[k + 1] = a, b
                if used >= budget:
                    break
            if improved or used >= budget:
                break
    return schedule
