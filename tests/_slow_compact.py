"""The slot-grid compaction as first written (a list per slot, linear scans), kept as the
specification that `pipeblocks.schedules._reorder.compact` must equal on every input."""
from __future__ import annotations

from collections.abc import Sequence

from pipeblocks.core.ir.actions import Action, Kind
from pipeblocks.core.cost.costs import StageCosts
from pipeblocks.core.ir.deps import requirements

__all__ = ["compact"]

Orders = tuple[tuple[Action, ...], ...]
_EPS = 1e-9


def _alloc(table: StageCosts, a: Action) -> float:
    return table.memory(a.kind, a.stage)[0]


def _release(table: StageCosts, a: Action) -> float:
    return table.memory(a.kind, a.stage)[1]


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
        lifted = grid.lift_tail_weights()
        grid.compact(caps)
        grid.place_first_free(lifted)
    return grid.orders()


class _Grid:
    """Per rank: which slots are busy, the activation held in each slot, and where each pass sits."""

    def __init__(self, timed: Sequence[Sequence[tuple[int, int, Action]]], table: StageCosts) -> None:
        self.table = table
        self.rank_of = table.placement.stage_to_rank
        self.horizon = max((s + n for row in timed for s, n, _ in row), default=0) + 1
        p = len(timed)
        self.busy = [bytearray(self.horizon * 2) for _ in range(p)]
        self.mem = [[0.0] * (self.horizon * 2 + 1) for _ in range(p)]
        self.where: dict[Action, tuple[int, int]] = {}
        for r, row in enumerate(timed):
            for s, n, a in row:
                self.where[a] = (s, n)
                self.busy[r][s : s + n] = b"\x01" * n
                self.mem[r][s] += _alloc(table, a)
                self.mem[r][s + n] += _release(table, a)
        for prof in self.mem:
            for t in range(1, len(prof)):
                prof[t] += prof[t - 1]

    def _shift_memory(self, r: int, a: Action, old: int | None, new: int | None) -> None:
        """Move a's allocation and release from slot `old` to slot `new` (None: absent)."""
        n = self.where.get(a, (0, 1))[1]
        prof = self.mem[r]
        end = len(prof)
        alloc, release = _alloc(self.table, a), _release(self.table, a)
        if old is not None and new is not None:  # only the slots between the two places change
            sign = 1.0 if new < old else -1.0
            lo, hi = min(old, new), max(old, new)
            for t in range(lo, hi):
                prof[t] += sign * alloc
            for t in range(lo + n, hi + n):
                prof[t] += sign * release
            return
        start, sign = (old, -1.0) if old is not None else (new, 1.0)
        if start is None:
            return
        for t in range(start, end):
            prof[t] += sign * alloc
        for t in range(start + n, end):
            prof[t] += sign * release

    def _earliest(self, a: Action) -> int:
        t = 0
        for phase, stage, mb, _ in requirements(a, self.table.placement.num_stages, 1):
            dep = Action(stage, Kind(phase), mb)
            s, n = self.where[dep] if dep in self.where else self.where[dep.with_kind(Kind.BW)]
            t = max(t, s + n)
        return t

    def compact(self, caps: Sequence[float]) -> None:
        for (cur, n), a in sorted((v, k) for k, v in self.where.items()):
            r = self.rank_of[a.stage]
            row, prof = self.busy[r], self.mem[r]
            alloc = _alloc(self.table, a)
            lowest = self._earliest(a)
            if alloc:  # an earlier F holds its activation longer: stop where the cap would break
                floor = cur
                while floor > lowest and prof[floor - 1] + alloc <= caps[r] + _EPS:
                    floor -= 1
                lowest = floor
            for s in range(lowest, cur):
                if any(row[t] for t in range(s, min(s + n, cur))):
                    continue
                row[cur : cur + n] = b"\x00" * n
                row[s : s + n] = b"\x01" * n
                self._shift_memory(r, a, cur, s)
                self.where[a] = (s, n)
                break

    def lift_tail_weights(self) -> list[Action]:
        last_f = {}
        for a, (s, _) in self.where.items():
            if a.kind is Kind.F:
                r = self.rank_of[a.stage]
                last_f[r] = max(last_f.get(r, -1), s)
        lifted = [a for a, (s, _) in self.where.items() if a.kind is Kind.W and s > last_f.get(self.rank_of[a.stage], -1)]
        for a in lifted:
            s, n = self.where[a]
            r = self.rank_of[a.stage]
            self._shift_memory(r, a, s, None)
            self.busy[r][s : s + n] = b"\x00" * n
        for a in lifted:
            del self.where[a]
        return lifted

    def place_first_free(self, actions: list[Action]) -> None:
        """Put each pass, in the order of its inputs' end, into its rank's first free slot."""
        for a in sorted(actions, key=lambda x: (self._earliest(x), x.stage)):
            r = self.rank_of[a.stage]
            row = self.busy[r]
            s = self._earliest(a)
            while row[s]:
                s += 1
            row[s] = 1
            self.where[a] = (s, 1)
            self._shift_memory(r, a, None, s)

    def orders(self) -> Orders:
        rows: list[list[tuple[int, Action]]] = [[] for _ in self.busy]
        for a, (s, _) in self.where.items():
            rows[self.rank_of[a.stage]].append((s, a))
        return tuple(tuple(a for _, a in sorted(row)) for row in rows)
