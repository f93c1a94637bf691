"""The slot grid that block-built schedules are compacted on.

Every pass of every microbatch sits on its rank's row of integer slots. Compaction visits
the passes in time order and moves each to the earliest free slots after its inputs end,
unless that would lift the rank's activation above its cap (`_reorder.compact` states the
rule; `tests/_slow_compact.py` is its specification).

A v-half schedule at p = 128, m = 1024 has 786,432 passes and every one of them moves, so
the grid holds passes as integer ids into flat lists (start and end slot; the ids of the
passes they wait for, rank and memory effect in one tuple), numbered in the order the
first round visits them: a visit is a few list reads and one `bytearray.find`, with no
tuple keys, dictionaries or `Action` objects, and reads memory front to back. The
activation profile stays a NumPy array per rank, changed by the same slice additions in
the same order as the first version, so every comparison with the cap sees the same
floating-point values.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.ir.actions import Action, Kind
from ..core.cost.costs import StageCosts

__all__ = ["KINDS", "SlotGrid"]

KINDS = (Kind.F, Kind.B, Kind.W, Kind.BW)  # a pass's kind code is its index here
_CODE = {kind: code for code, kind in enumerate(KINDS)}
_EPS = 1e-9


class SlotGrid:
    """Passes (ids 0..N-1 by start slot, length and stage; `source` maps them to the order
    given) on a per-rank slot grid.

    Per rank: which slots are busy (a byte per slot, searched with `bytearray.find`) and
    the activation held in each slot (a float array, moved with range updates). Per pass:
    its start slot (the state that compaction changes), its length, and whether it is on
    the grid (the lifted cool-down Ws are off it for a while).
    """

    def __init__(
        self,
        slots: Sequence[int],
        lengths: Sequence[int],
        stages: Sequence[int],
        kinds: Sequence[int],
        microbatches: Sequence[int],
        table: StageCosts,
    ) -> None:
        placement = table.placement
        self.table = table
        self.p = placement.num_ranks
        stage, kind, mb, slot, length = (
            np.asarray(x, dtype=np.int64) for x in (stages, kinds, microbatches, slots, lengths)
        )
        # Pass ids follow the first round's visit order, not the order given (`source[i]` is
        # pass i's place in it): a round then reads its lists front to back, and a pass's
        # inputs sit a little before it, where the memory caches still hold them.
        self.source = np.lexsort((stage, length, slot))
        stage, kind, mb, slot, length = (x[self.source] for x in (stage, kind, mb, slot, length))
        self.count = len(slot)
        self.stage, self.kind, self.microbatch = stage, kind, mb
        self.rank_arr = np.asarray(placement.stage_to_rank, dtype=np.int64)[stage]
        self.start: list[int] = slot.tolist()
        self.length: list[int] = length.tolist()
        # where each pass ends, and a last entry 0: the end of "no input" (id -1) is slot 0
        self.end: list[int] = (slot + length).tolist() + [0]
        self.rank: list[int] = self.rank_arr.tolist()
        self.on_grid = np.ones(self.count, dtype=bool)
        self.capped = bytearray(self.count)  # passes that met their rank's cap in a round
        # as arrays for the sweeps over all passes, as lists for the visits one pass at a time
        self.deps = _dependencies(stage, kind, mb, placement.num_stages)
        self.dep1, self.dep2 = self.deps.tolist()
        memory = np.array([[table.memory(k, s) for k in KINDS] for s in range(placement.num_stages)], dtype=np.float64)
        self.effect = memory[stage, kind]  # (allocated at start, released at end) per pass
        self.alloc, self.release = self.effect.T.tolist()
        # what a visit reads of a pass, in one tuple: its inputs, rank and memory effect
        self.fixed = list(zip(self.dep1, self.dep2, self.rank, self.alloc, self.release))
        horizon = int((slot + length).max(initial=0)) + 1
        self.size = size = horizon * 2
        rank = self.rank_arr
        cells = np.zeros((self.p, size), dtype=np.uint8)
        for k in range(int(length.max(initial=1))):
            longer = length > k
            cells[rank[longer], slot[longer] + k] = 1
        self.busy = [bytearray(row.tobytes()) for row in cells]
        # a slot of a rank holds at most one start and one end, so each delta is a single
        # sum, and the running sum along a row (cumsum is sequential) is the slot-by-slot one
        deltas = np.zeros((self.p, size + 1), dtype=np.float64)
        deltas[rank, slot] += memory[stage, kind, 0]
        deltas[rank, slot + length] += memory[stage, kind, 1]
        profile = np.cumsum(deltas, axis=1)
        self.mem: list[np.ndarray] = list(profile)  # row views: updated in place

    @staticmethod
    def from_timed(timed: Sequence[Sequence[tuple[int, int, Action]]], table: StageCosts) -> tuple[SlotGrid, list[Action]]:
        """A grid from (start slot, length, action) per rank, and its actions by pass id."""
        actions = [a for row in timed for _, _, a in row]
        grid = SlotGrid(
            [s for row in timed for s, _, _ in row], [n for row in timed for _, n, _ in row],
            [a.stage for a in actions], [_CODE[a.kind] for a in actions], [a.microbatch for a in actions], table,
        )
        return grid, [actions[j] for j in grid.source.tolist()]

    # ---- state ------------------------------------------------------------------
    def slots(self) -> np.ndarray:
        """The start slot of every pass now."""
        return np.array(self.start, dtype=np.int64)

    def rank_orders(self, slots: np.ndarray | None = None) -> list[np.ndarray]:
        """Per rank, the ids of its passes on the grid in slot order (of `slots`, default now)."""
        slots = self.slots() if slots is None else slots
        ids = np.flatnonzero(self.on_grid)
        ids = ids[np.lexsort((slots[ids], self.rank_arr[ids]))]
        bounds = np.searchsorted(self.rank_arr[ids], np.arange(self.p + 1))
        return [ids[bounds[r] : bounds[r + 1]] for r in range(self.p)]

    def earliest(self, i: int) -> int:
        """The first slot pass i may start at: the end of the passes it waits for."""
        return max(self.end[self.dep1[i]], self.end[self.dep2[i]])

    # ---- moves ------------------------------------------------------------------
    def compact(self, caps: Sequence[float], *, lifted: Sequence[int] = ()) -> None:
        """One round: each pass on the grid, in (slot, length, stage) order, moves to the
        earliest free slots after its inputs, stopping where its allocation would break
        its rank's cap.

        `lifted`: the passes `lift_tail_weights` took off since the last round. Such a round
        starts from a compacted grid, in which no pass can move unless it met its cap last
        round or a lifted pass freed a slot before it on its rank: every other pass took the
        first free slots after its inputs, and the passes visited after it only filled slots
        before it and emptied slots after it, while its inputs stayed. Until one of those
        passes moves, the round visits only them (at p = 128, m = 1024 the first move comes
        after 97% of the passes).
        """
        slots = self.slots()
        ids = np.flatnonzero(self.on_grid)
        # a slot starts at most one pass per rank, and a stage lives on one rank: no ties
        visit = ids[np.lexsort((self.stage[ids], np.asarray(self.length)[ids], slots[ids]))]
        start, end, length, fixed = self.start, self.end, self.length, self.fixed
        busy, mem, capped = self.busy, self.mem, self.capped
        limits = [c + _EPS for c in caps]
        peak = np.maximum.reduce

        def place(i: int) -> bool:
            """Move pass i as far forward as it may go; whether it moved."""
            input1, input2, r, alloc, release = fixed[i]
            cur = start[i]
            lo = end[input1]
            if end[input2] > lo:
                lo = end[input2]
            if lo >= cur:  # already as early as its inputs allow
                return False
            n = length[i]
            row = busy[r]
            s = row.find(0, lo, cur) if n == 1 else _first_free(row, lo, cur, n)
            if s < 0:
                return False
            prof = mem[r]
            if alloc:
                # an earlier F holds its activation longer: stop where the cap would break (the
                # maximum decides whether any slot breaks it; addition is monotonic in floats)
                held = prof[s:cur]
                if peak(held) + alloc > limits[r]:
                    capped[i] = 1
                    bad = np.flatnonzero(held + alloc > limits[r])
                    s = _first_free(row, s + int(bad[-1]) + 1, cur, n)
                    if s < 0:
                        return False
                    held = prof[s:cur]
            if n == 1:
                row[cur] = 0
                row[s] = 1
            else:
                row[cur : cur + n] = b"\x00" * n
                row[s : s + n] = b"\x01" * n
            # the pass now allocates at s and releases at s + n: only the slots between change
            # (in place, through views: the same additions as `prof[s:cur] += alloc`)
            if alloc:
                held += alloc
            if release:
                freed = prof[s + n : cur + n]
                freed += release
            start[i], end[i] = s, s + n
            return True

        first = 0
        if len(lifted):
            first_freed = np.full(self.p, np.iinfo(np.int64).max)
            np.minimum.at(first_freed, self.rank_arr[lifted], slots[lifted])
            movable = (slots[visit] > first_freed[self.rank_arr[visit]]) | (np.frombuffer(capped, np.uint8)[visit] > 0)
            first = len(visit)
            for k in np.flatnonzero(movable).tolist():
                if place(int(visit[k])):
                    first = k + 1
                    break
        for i in visit[first:].tolist():
            place(i)

    def lift_tail_weights(self) -> list[int]:
        """Take off the grid the Ws after their rank's last F; their ids, in the order the
        passes were given (the order their memory is taken off in)."""
        slots = self.slots()
        is_f = self.on_grid & (self.kind == _CODE[Kind.F])
        last_f = np.full(self.p, -1, dtype=np.int64)
        np.maximum.at(last_f, self.rank_arr[is_f], slots[is_f])
        lifted = np.flatnonzero(self.on_grid & (self.kind == _CODE[Kind.W]) & (slots > last_f[self.rank_arr]))
        lifted = lifted[np.argsort(self.source[lifted])].tolist()
        for i in lifted:
            s, n, r = self.start[i], self.length[i], self.rank[i]
            prof = self.mem[r]
            if self.alloc[i]:
                prof[s:] += -1.0 * self.alloc[i]
            if self.release[i]:
                prof[s + n :] += -1.0 * self.release[i]
            self.busy[r][s : s + n] = b"\x00" * n
        self.on_grid[lifted] = False
        return lifted

    def place_first_free(self, ids: list[int]) -> None:
        """Put each pass (one slot), in the order of its inputs' end, into its rank's first free slot."""
        for i in sorted(ids, key=lambda x: (self.earliest(x), int(self.stage[x]))):
            r = self.rank[i]
            row = self.busy[r]
            s = row.find(0, self.earliest(i))
            row[s] = 1
            self.start[i], self.end[i], self.length[i] = s, s + 1, 1
            self.on_grid[i] = True
            prof = self.mem[r]
            if self.alloc[i]:
                prof[s:] += 1.0 * self.alloc[i]
            if self.release[i]:
                prof[s + 1 :] += 1.0 * self.release[i]


def _dependencies(stage: np.ndarray, kind: np.ndarray, mb: np.ndarray, num_stages: int) -> np.ndarray:
    """Per pass (a column), the ids of the (at most two) passes whose end it waits for, -1 for none:
    an F its previous stage's F; a B or BW its own F and the next stage's B or BW; a W its
    B (the rules of `core.ir.deps` for one sequence chunk)."""
    count = len(stage)
    if count == 0:
        return np.full((2, 0), -1, dtype=np.int64)
    S = num_stages
    F, B, W, BW = (_CODE[k] for k in KINDS)
    # a dense index (microbatch, stage, kind) -> id
    index = np.full((int(mb.max()) + 1) * S * 4 + 4, -1, dtype=np.int64)
    index[(mb * S + stage) * 4 + kind] = np.arange(count)

    def lookup(st: np.ndarray, k: int) -> np.ndarray:
        return index[(mb * S + np.clip(st, 0, S - 1)) * 4 + k]

    def backward(st: np.ndarray) -> np.ndarray:  # B, or the fused BW where there is no B
        b = lookup(st, B)
        return np.where(b >= 0, b, lookup(st, BW))

    dep1 = np.full(count, -1, dtype=np.int64)
    dep2 = np.full(count, -1, dtype=np.int64)
    is_f, is_w = kind == F, kind == W
    is_back = (kind == B) | (kind == BW)
    dep1 = np.where(is_f & (stage > 0), lookup(stage - 1, F), dep1)
    dep1 = np.where(is_w, backward(stage), dep1)
    dep1 = np.where(is_back, lookup(stage, F), dep1)
    dep2 = np.where(is_back & (stage < S - 1), backward(stage + 1), dep2)
    return np.stack([dep1, dep2])


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
