"""Timing and reordering of per-rank pass orders, for block-built schedules.

The reorder loop times many candidate orders, so this module replays an order under the
resolved costs directly, without the validation and lowering `simulate` does, with the
same rules (a pass starts when its rank is free and its inputs have
arrived, t_comm after they were produced on another rank) and the same memory model
(allocate at the start of F, release at the end of B/W/BW). `pipeblocks.core.simulate`
stays the reference; the tests hold the two in agreement.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.actions import Action, Kind
from ..core.costs import Costs, StageCosts
from ..core.deps import phase_of, requirements
from ..core.placement import Placement

__all__ = ["compact", "compact_both", "cost_table", "peaks_of", "replay", "replay_spans"]

Orders = tuple[tuple[Action, ...], ...]
_EPS = 1e-9


def cost_table(placement: Placement, costs: Costs | None) -> StageCosts:
    """Per-stage costs for `placement`; unit costs for None."""
    return (costs or Costs()).resolve(placement)


def _duration(table: StageCosts, a: Action) -> float:
    return table.duration(a.kind, a.stage)


def _memory_table(table: StageCosts) -> dict[tuple[int, Kind], tuple[float, float]]:
    """(allocated, released) per (stage, kind)."""
    return {(s, k): table.memory(k, s) for s in range(table.placement.num_stages) for k in Kind}


def peaks_of(orders: Orders, table: StageCosts) -> tuple[float, ...]:
    """Peak activation per rank; it depends on the order alone."""
    memory = _memory_table(table)
    out = []
    for row in orders:
        held = top = 0.0
        for a in row:
            alloc, release = memory[(a.stage, a.kind)]
            held += alloc
            if held > top:
                top = held
            held += release
        out.append(top)
    return tuple(out)


_PHASES = {"F": 0, "B": 1, "W": 2}


def _templates(table: StageCosts):
    """Per (stage, kind): (duration, ((phase slot, delay), ...) needed, (phase slot, ...) done).

    A phase of (stage, microbatch) lives at index microbatch * 3S + phase slot, where the
    slot is 3 * stage + (0 F, 1 B, 2 W): the same rules as `requirements` and `phase_of`
    for one sequence chunk, so the replay loop builds neither actions nor tuple keys."""
    placement = table.placement
    rank_of = placement.stage_to_rank
    out = {}
    for stage in range(placement.num_stages):
        for kind in Kind:
            probe = Action(stage, kind, 0)
            needs = tuple(
                (3 * st + _PHASES[ph], table.t_comm if rank_of[st] != rank_of[stage] else 0.0)
                for ph, st, _, _ in requirements(probe, placement.num_stages, 1)
            )
            done = tuple(3 * stage + _PHASES[ph] for ph, _, _, _ in phase_of(probe))
            out[(stage, kind)] = (_duration(table, probe), needs, done)
    return out


def replay(orders: Orders, table: StageCosts, m: int | None = None) -> tuple[float, float]:
    """(makespan, longest rank span) of the orders under the table; a rank's span runs
    from the start of its first pass to the end of its last. Infinite if they cannot
    complete. `m`, the microbatch count, saves a scan when known."""
    spans = replay_spans(orders, table, m)
    if spans is None:
        return (float("inf"), float("inf"))
    return spans[0], max(spans[1])


def replay_spans(
    orders: Orders, table: StageCosts, m: int | None = None
) -> tuple[float, tuple[float, ...]] | None:
    """(makespan, per-rank spans) of the orders under the table, or None if they cannot
    complete (a cross-rank deadlock, or a pass before its own rank's input). `m` (more
    than the largest microbatch index) saves a scan when known."""
    p = len(orders)
    templates = _templates(table)
    width = 3 * table.placement.num_stages
    if m is None:
        m = 1 + max((a.microbatch for row in orders for a in row), default=0)
    done: list[float | None] = [None] * (m * width)
    parked: dict[int, list[int]] = {}
    cursor, clock = [0] * p, [0.0] * p
    first: list[float | None] = [None] * p
    ready = list(range(p))
    while ready:
        r = ready.pop()
        row, pos, now = orders[r], cursor[r], clock[r]
        n = len(row)
        while pos < n:
            a = row[pos]
            base = a.microbatch * width
            duration, needs, phases = templates[(a.stage, a.kind)]
            start = now
            blocked = -1
            for slot, delay in needs:
                t = done[base + slot]
                if t is None:
                    blocked = base + slot
                    break
                t += delay
                if t > start:
                    start = t
            if blocked >= 0:
                parked.setdefault(blocked, []).append(r)
                break
            if first[r] is None:
                first[r] = start
            now = start + duration
            for slot in phases:
                done[base + slot] = now
                if parked:
                    woken = parked.pop(base + slot, None)
                    if woken:
                        ready.extend(woken)
            pos += 1
        cursor[r], clock[r] = pos, now
    if any(cursor[r] < len(orders[r]) for r in range(p)):
        return None
    return max(clock), tuple(clock[r] - (first[r] or 0.0) for r in range(p))


def compact(
    timed: Sequence[Sequence[tuple[int, int, Action]]],
    table: StageCosts,
    caps: Sequence[float],
    *,
    float_weights: bool = True,
) -> Orders:
    """Reorder on the slot grid: visit passes in time order and move each to the earliest
    free slots on its rank after its inputs end, unless that would lift the rank's memory
    above its cap. Moving a pass earlier never breaks a later pass, so the result is valid.

    With `float_weights`, a second round lifts the Ws that run after their rank's last F
    (where memory only falls), compacts again so the cool-down's B chain is not held up
    by them, and puts them back first-in first-out into the earliest free slots.

    `timed[r]` holds (start slot, length, action) for rank r (the tiled block).
    """
    grid = _Grid(timed, table)
    grid.compact(caps)
    if float_weights:
        _float_weights(grid, caps)
    return grid.orders()


def compact_both(
    timed: Sequence[Sequence[tuple[int, int, Action]]], table: StageCosts, caps: Sequence[float]
) -> tuple[Orders, Orders]:
    """`compact` without and with `float_weights`, sharing the first round."""
    grid = _Grid(timed, table)
    grid.compact(caps)
    plain = grid.orders()
    _float_weights(grid, caps)
    return plain, grid.orders()


def _float_weights(grid: _Grid, caps: Sequence[float]) -> None:
    lifted = grid.lift_tail_weights()
    grid.compact(caps)
    grid.place_first_free(lifted)


class _Grid:
    """Per rank: which slots are busy (a byte per slot, searched with `bytearray.find`), the
    activation held in each slot (a float array, moved with range updates), and where each
    pass sits. Passes are keyed by (stage, kind, microbatch), which sorts as `Action` does."""

    def __init__(self, timed: Sequence[Sequence[tuple[int, int, Action]]], table: StageCosts) -> None:
        self.table = table
        self.rank_of = table.placement.stage_to_rank
        self.last = table.placement.num_stages - 1
        self.mem_of = _memory_table(table)
        self.horizon = max((s + n for row in timed for s, n, _ in row), default=0) + 1
        p = len(timed)
        size = self.horizon * 2
        self.busy = [bytearray(size) for _ in range(p)]
        self.mem = []
        self.where: dict[tuple[int, Kind, int], tuple[int, int]] = {}
        self.action: dict[tuple[int, Kind, int], Action] = {}
        for r, row in enumerate(timed):
            deltas = [0.0] * (size + 1)
            for s, n, a in row:
                key = (a.stage, a.kind, a.microbatch)
                self.where[key] = (s, n)
                self.action[key] = a
                self.busy[r][s : s + n] = b"\x01" * n
                alloc, release = self.mem_of[(a.stage, a.kind)]
                deltas[s] += alloc
                deltas[s + n] += release
            # a running sum in slot order, as a Python loop would add them (cumsum is sequential)
            self.mem.append(np.cumsum(np.array(deltas, dtype=np.float64)))

    def _shift_memory(self, r: int, key: tuple[int, Kind, int], old: int | None, new: int | None) -> None:
        """Move a pass's allocation and release from slot `old` to slot `new` (None: absent)."""
        n = self.where.get(key, (0, 1))[1]
        prof = self.mem[r]
        alloc, release = self.mem_of[(key[0], key[1])]
        # adding a zero changes no slot: skip it (a pass either allocates or releases, mostly)
        if old is not None and new is not None:  # only the slots between the two places change
            sign = 1.0 if new < old else -1.0
            lo, hi = min(old, new), max(old, new)
            if alloc:
                prof[lo:hi] += sign * alloc
            if release:
                prof[lo + n : hi + n] += sign * release
            return
        start, sign = (old, -1.0) if old is not None else (new, 1.0)
        if start is None:
            return
        if alloc:
            prof[start:] += sign * alloc
        if release:
            prof[start + n :] += sign * release

    def _earliest(self, key: tuple[int, Kind, int]) -> int:
        stage, kind, mb = key
        where = self.where
        if kind is Kind.F:
            if stage == 0:
                return 0
            s, n = where[(stage - 1, Kind.F, mb)]
            return s + n
        if kind is Kind.W:
            s, n = where.get((stage, Kind.B, mb)) or where[(stage, Kind.BW, mb)]
            return s + n
        s, n = where[(stage, Kind.F, mb)]
        t = s + n
        if stage < self.last:
            s, n = where.get((stage + 1, Kind.B, mb)) or where[(stage + 1, Kind.BW, mb)]
            t = max(t, s + n)
        return t

    def _visit_order(self) -> list[tuple[int, Kind, int]]:
        """The passes by (start, length, stage, kind, microbatch), as sorting the
        ((start, length), key) pairs would give: bucketed by start slot, then each slot's
        passes sorted by (length, stage), which is unique there (a stage lives on one rank
        and a rank starts one pass per slot)."""
        stages = self.last + 1
        buckets: list[list | None] = [None] * (2 * self.horizon + 1)
        for key, (s, n) in self.where.items():
            bucket = buckets[s]
            if bucket is None:
                buckets[s] = [(n * stages + key[0], key)]
            else:
                bucket.append((n * stages + key[0], key))
        out = []
        for bucket in buckets:
            if bucket is not None:
                if len(bucket) > 1:
                    bucket.sort()
                out.extend(key for _, key in bucket)
        return out

    def compact(self, caps: Sequence[float]) -> None:
        where = self.where
        for key in self._visit_order():
            cur, n = where[key]
            r = self.rank_of[key[0]]
            row, prof = self.busy[r], self.mem[r]
            lowest = self._earliest(key)
            s = _first_free(row, lowest, cur, n)
            if s < 0:
                continue
            alloc = self.mem_of[(key[0], key[1])][0]
            if alloc:  # an earlier F holds its activation longer: stop where the cap would break
                # the cap binds only if it breaks between the first free slot and cur
                bad = np.flatnonzero(prof[s:cur] + alloc > caps[r] + _EPS)
                if bad.size:
                    s = _first_free(row, s + int(bad[-1]) + 1, cur, n)
                    if s < 0:
                        continue
            row[cur : cur + n] = b"\x00" * n
            row[s : s + n] = b"\x01" * n
            self._shift_memory(r, key, cur, s)
            self.where[key] = (s, n)

    def lift_tail_weights(self) -> list[tuple[int, Kind, int]]:
        last_f: dict[int, int] = {}
        for (stage, kind, _), (s, _) in self.where.items():
            if kind is Kind.F:
                r = self.rank_of[stage]
                last_f[r] = max(last_f.get(r, -1), s)
        lifted = [
            key for key, (s, _) in self.where.items() if key[1] is Kind.W and s > last_f.get(self.rank_of[key[0]], -1)
        ]
        for key in lifted:
            s, n = self.where[key]
            r = self.rank_of[key[0]]
            self._shift_memory(r, key, s, None)
            self.busy[r][s : s + n] = b"\x00" * n
        for key in lifted:
            del self.where[key]
        return lifted

    def place_first_free(self, keys: list[tuple[int, Kind, int]]) -> None:
        """Put each pass, in the order of its inputs' end, into its rank's first free slot."""
        for key in sorted(keys, key=lambda x: (self._earliest(x), x[0])):
            r = self.rank_of[key[0]]
            row = self.busy[r]
            s = row.find(0, self._earliest(key))
            row[s] = 1
            self.where[key] = (s, 1)
            self._shift_memory(r, key, None, s)

    def orders(self) -> Orders:
        # a rank runs one pass per slot: lay the passes out by start slot
        rows: list[list[Action | None]] = [[None] * len(row) for row in self.busy]
        for key, (s, _) in self.where.items():
            rows[self.rank_of[key[0]]][s] = self.action[key]
        return tuple(tuple(a for a in row if a is not None) for row in rows)


def _first_free(row: bytearray, lo: int, cur: int, n: int) -> int:
    """The smallest s in [lo, cur) with row[s : min(s + n, cur)] free (a pass of n slots at
    `cur` may overlap its own old place), or -1."""
    if lo >= cur:
        return -1
    if n == 1:
        return row.find(0, lo, cur)
    found = row.find(b"\x00" * n, lo, cur)
    if found >= 0:
        return found
    for s in range(max(lo, cur - n + 1), cur):
        if not any(row[s:cur]):
            return s
    return -1
