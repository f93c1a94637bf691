"""The building-block API: one microbatch's passes on a device x time grid, repeated.

A block says, for one microbatch, where every pass of every stage starts (an integer
slot) and how many slots it takes; the placement says which rank runs each stage. The
block is repeated every `interval` slots (T) for each further microbatch. From a block
pipeblocks derives

  * whether it tiles: no pass may collide with a shifted copy of any pass of the same
    rank (the error names the two passes, their slots and the free residues);
  * each stage's lifespan l_s (start of its F to the end of the pass that frees the
    activation: W, or BW when fused) and the lifespan bound on peak activation memory
    per rank, sum over its stages of ceil(l_s / T) * (activation of one microbatch on s);
  * a full schedule (`build`): repeat for m microbatches, squeeze, and reorder warm-up
    and cool-down by moving passes into earlier free slots, never holding more
    activation than the tiled schedule did (nor more than the lifespan bound); the
    order that replays fastest under the given costs is kept.

Text form of a block pass: `<stage><kind>@<start>[:<length>]`, for example::

    >>> from pipeblocks.core import Placement
    >>> blk = Block.parse(Placement.loop(2), "0F@0 1F@1 1B@2 1W@3 0B@4 0W@5", interval=3)
    >>> blk.lifespans
    (6, 3)
    >>> blk.lifespan_bound()
    (2.0, 1.0)
    >>> s = build(blk, m=4, name="my-1f1b")

The V schedules (`v-min`, `v-half`, `v-zb`, `1f1b-v`, `v-adaptive`) are built through
this same API.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..core.ir.actions import Action, Kind
from ..core.cost.costs import StageCosts
from ..core.ir.deps import phase_of, requirements
from ..core.ir.errors import ScheduleError, check_counts
from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ._progress import Progress
from ._grid import KINDS, SlotGrid
from ._grid_timing import layout_peaks, layout_replay
from ._reorder import cost_table, float_weights_of, orders_of

__all__ = ["BlockPass", "Block", "tile", "build", "build_orders", "fit_block"]

_PASS_RE = re.compile(r"^(\d+)(BW|F|B|W)@(\d+)(?::(\d+))?$")


@dataclass(frozen=True, slots=True)
class BlockPass:
    """Pass `kind` of global `stage` for one microbatch, in slots [start, start + length)."""

    stage: int
    kind: Kind
    start: int
    length: int = 1

    def __post_init__(self) -> None:
        if self.stage < 0 or self.start < 0 or self.length < 1:
            raise ScheduleError(f"block pass {self}: stage and start must be >= 0 and length >= 1")

    @property
    def end(self) -> int:
        return self.start + self.length

    def action(self, microbatch: int) -> Action:
        return Action(self.stage, self.kind, microbatch)

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}@{self.start}"
        return text if self.length == 1 else f"{text}:{self.length}"

    @staticmethod
    def parse(text: str) -> BlockPass:
        match = _PASS_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse block pass {text!r}: expected <stage><F|B|W|BW>@<start>[:<length>], "
                "for example 3F@5 or 0BW@9:2"
            )
        stage, kind, start, length = match.groups()
        return BlockPass(int(stage), Kind(kind), int(start), int(length or 1))


@dataclass(frozen=True)
class Block:
    """All passes of one microbatch, repeated every `interval` slots.

    placement: which rank runs each global stage.
    passes: every stage's F and either B and W or a fused BW, exactly once.
    interval: the repeat interval T in slots.

    Construction checks completeness, the dependencies inside the microbatch (a pass
    starts no earlier than the end of the passes it needs) and tiling; each failure is a
    ScheduleError that names the passes and the fix.
    """

    placement: Placement
    passes: tuple[BlockPass, ...]
    interval: int

    def __post_init__(self) -> None:
        if not isinstance(self.interval, int) or self.interval < 1:
            raise ScheduleError(f"block interval must be an integer >= 1, got {self.interval!r}")
        object.__setattr__(self, "passes", tuple(sorted(self.passes, key=lambda x: (x.start, x.stage))))
        self._check_complete()
        self._check_dependencies()
        self._check_tiling()

    # ---- construction -----------------------------------------------------------
    @staticmethod
    def parse(placement: Placement, text: str, *, interval: int) -> Block:
        """A block from its text form, e.g. "0F@0 1F@1 1B@2 1W@3 0B@4 0W@5"."""
        return Block(placement, tuple(BlockPass.parse(t) for t in text.split()), interval)

    def to_text(self) -> str:
        return " ".join(map(str, self.passes))

    # ---- derived quantities -------------------------------------------------------
    @property
    def p(self) -> int:
        return self.placement.num_ranks

    def rank_of(self, bp: BlockPass) -> int:
        return self.placement.stage_to_rank[bp.stage]

    def pass_of(self, stage: int, kind: Kind) -> BlockPass:
        for bp in self.passes:
            if bp.stage == stage and bp.kind is kind:
                return bp
        raise ScheduleError(f"block has no {stage}{kind.value} pass")

    @functools.cached_property
    def lifespans(self) -> tuple[int, ...]:
        """Per global stage: end of its freeing pass (W or BW) minus start of its F."""
        start: dict[int, int] = {}
        end: dict[int, int] = {}
        for bp in self.passes:
            if bp.kind is Kind.F:
                start[bp.stage] = bp.start
            elif bp.kind in (Kind.W, Kind.BW):
                end[bp.stage] = max(end.get(bp.stage, bp.end), bp.end)
        return tuple(end[stage] - start[stage] for stage in range(self.placement.num_stages))

    def lifespan_bound(self, mem_b: float | Sequence[float] = 1.0) -> tuple[float, ...]:
        """Per rank: sum over its stages of ceil(l_s / T) times the stage's activation.

        `mem_b` is the activation of one microbatch on a full stage (1/p of the model), as
        in `Costs.mem_b`: a scalar is scaled by the stage fraction (a V chunk holds half),
        a per-stage sequence is taken as given.
        """
        frac = self.placement.stage_fraction
        per_stage = (
            tuple(float(x) for x in mem_b) if isinstance(mem_b, Sequence) else (float(mem_b) * frac,) * len(self.lifespans)
        )
        bound = [0.0] * self.p
        for stage, life in enumerate(self.lifespans):
            bound[self.placement.stage_to_rank[stage]] += math.ceil(life / self.interval) * per_stage[stage]
        return tuple(bound)

    def diagram(self) -> str:
        """One line per rank: the block on the slot grid (`.` idle), for docs and errors."""
        width = max(bp.end for bp in self.passes)
        cells = [["."] * width for _ in range(self.p)]
        for bp in self.passes:
            for t in range(bp.start, bp.end):
                cells[self.rank_of(bp)][t] = f"{bp.stage}{bp.kind.value}"
        size = max(len(c) for row in cells for c in row)
        return "\n".join(f"{r}: " + " ".join(c.rjust(size) for c in row) for r, row in enumerate(cells))

    # ---- checks ---------------------------------------------------------------------
    def _check_complete(self) -> None:
        S = self.placement.num_stages
        kinds: dict[int, list[Kind]] = {s: [] for s in range(S)}
        for bp in self.passes:
            if bp.stage >= S:
                raise ScheduleError(f"block pass {bp}: stage {bp.stage} does not exist (stages 0..{S - 1})")
            if bp.kind in kinds[bp.stage]:
                raise ScheduleError(f"block lists {bp.stage}{bp.kind.value} twice; each pass appears once per block")
            kinds[bp.stage].append(bp.kind)
        for stage, have in kinds.items():
            fused, split = Kind.BW in have, (Kind.B in have, Kind.W in have)
            if Kind.F in have and ((fused and split == (False, False)) or (not fused and split == (True, True))):
                continue
            if fused and any(split):
                raise ScheduleError(f"block stage {stage} has both BW and B/W passes; use either BW or B then W")
            lacking = "F" if Kind.F not in have else "W" if split[0] else "B" if split[1] else "BW (or B and W)"
            raise ScheduleError(f"block lacks stage {stage}'s {lacking} pass; every stage needs F and B+W or BW")

    def _check_dependencies(self) -> None:
        S = self.placement.num_stages
        finish: dict[tuple[str, int], int] = {}
        for bp in self.passes:
            for phase, stage, _, _ in phase_of(bp.action(0)):
                finish[(phase, stage)] = bp.end
        for bp in self.passes:
            for phase, stage, _, _ in requirements(bp.action(0), S, 1):
                need = finish[(phase, stage)]
                if bp.start < need:
                    raise ScheduleError(
                        f"block pass {bp} starts at slot {bp.start}, before {stage}{phase} ends at slot {need}, "
                        f"which it depends on: start {bp.stage}{bp.kind.value} at slot {need} or later"
                    )

    def _check_tiling(self) -> None:
        T = self.interval
        by_rank: list[list[BlockPass]] = [[] for _ in range(self.p)]
        for bp in self.passes:  # one sweep, not one per rank: a V block at p = 128 has 768 passes
            by_rank[self.rank_of(bp)].append(bp)
        for rank, mine in enumerate(by_rank):
            work = sum(bp.length for bp in mine)
            if work > T:
                raise ScheduleError(
                    f"block does not tile: rank {rank} has {work} slots of work per microbatch "
                    f"({' '.join(map(str, mine))}) but the interval is T={T}; raise the interval to at least {work}"
                )
            owner: dict[int, tuple[BlockPass, int]] = {}
            for bp in mine:
                for slot in range(bp.start, bp.end):
                    residue = slot % T
                    if residue in owner:
                        other, other_slot = owner[residue]
                        used = {t % T for q in mine for t in range(q.start, q.end)}
                        free = sorted(set(range(T)) - used)
                        lag = (slot - other_slot) // T
                        raise ScheduleError(
                            f"block does not tile with interval T={T}: on rank {rank}, {other} (slot {other_slot}) "
                            f"and {bp} (slot {slot}) fall on the same residue {residue} mod {T}, so microbatch j's "
                            f"{other.stage}{other.kind.value} collides with microbatch j-{lag}'s "
                            f"{bp.stage}{bp.kind.value}; move one of them to a free residue "
                            f"({', '.join(map(str, free)) or 'none'}) or change the interval"
                        )
                    owner[residue] = (bp, slot)


def tile(block: Block, m: int) -> tuple[tuple[tuple[int, Action], ...], ...]:
    """Per rank, (slot, action) for m copies of the block, in slot order."""
    check_counts(m=m)
    rows: list[list[tuple[int, Action]]] = [[] for _ in range(block.p)]
    for j in range(m):
        for bp in block.passes:
            rows[block.rank_of(bp)].append((bp.start + j * block.interval, bp.action(j)))
    return tuple(tuple(sorted(row, key=lambda x: x[0])) for row in rows)


def build_orders(
    block: Block, m: int, *, costs: object | None = None, memory_cap: float | Sequence[float] | None = None
) -> tuple[tuple[tuple[Action, ...], ...], tuple[float, float], tuple[float, ...]]:
    """The best per-rank orders for m microbatches: (orders, times, peaks), where times is
    (makespan, longest rank span) replayed under costs, compared in that order.

    Candidates: the tiled order (squeezed by replay) and two compactions of it on the
    slot grid under a memory cap per rank (with and without floating the cool-down Ws). The cap defaults to the smaller of the tiled schedule's
    largest rank peak and the rank's lifespan bound, so reordering never raises the
    peak; an explicit `memory_cap` (one value, or one per rank) replaces it.
    """
    check_counts(m=m)
    table = cost_table(block.placement, costs)
    grid = _tiled_grid(block, m, table)
    # the candidates are layouts of one grid (a start slot per pass), timed without orders
    tiled = grid.slots()
    tiled_peaks = layout_peaks(grid, tiled)
    if memory_cap is None:
        bound = block.lifespan_bound(table.mem_b)
        top = max(tiled_peaks)
        caps = tuple(max(min(top, b), own) for b, own in zip(bound, tiled_peaks))
    elif isinstance(memory_cap, Sequence):
        caps = tuple(float(c) for c in memory_cap)
    else:
        caps = (float(memory_cap),) * block.p
    best = None
    progress = Progress(f"block build p={block.p} m={m}")
    # compaction never raises a rank above its cap, but it cannot bring a tiled peak under it
    grid.compact(caps)
    plain = grid.slots()
    float_weights_of(grid, caps)
    floated = grid.slots()
    for label, slots in (("tiled", tiled), ("compacted", plain), ("compacted with the cool-down Ws floated", floated)):
        progress.step(f"{label} order built")
        peaks = layout_peaks(grid, slots)
        if any(x > c + 1e-9 for x, c in zip(peaks, caps)):
            continue
        candidate = (layout_replay(grid, slots), slots, peaks)
        if best is None or candidate[0] < best[0]:
            best = candidate
    if best is None:
        raise ScheduleError(
            f"no order of this block fits the memory cap {max(caps):g} (the tiled schedule needs "
            f"{max(tiled_peaks):g}): raise the cap or choose a block with shorter lifespans"
        )
    return orders_of(grid, slots=best[1]), best[0], best[2]


def _tiled_grid(block: Block, m: int, table: StageCosts) -> SlotGrid:
    """The block repeated m times on the slot grid, the passes given rank by rank, then by
    microbatch, then in block order (`compact`'s order: the lifted Ws are taken off in it)."""
    mine: list[list[BlockPass]] = [[] for _ in range(block.p)]
    for bp in block.passes:
        mine[block.rank_of(bp)].append(bp)
    code = {kind: c for c, kind in enumerate(KINDS)}
    j = np.arange(m, dtype=np.int64)
    columns: list[list[np.ndarray]] = [[], [], [], [], []]
    for passes in mine:
        if not passes:
            continue
        starts = np.array([bp.start for bp in passes], dtype=np.int64)
        columns[0].append((j[:, None] * block.interval + starts[None, :]).ravel())
        columns[1].append(np.tile([bp.length for bp in passes], m))
        columns[2].append(np.tile([bp.stage for bp in passes], m))
        columns[3].append(np.tile([code[bp.kind] for bp in passes], m))
        columns[4].append(np.repeat(j, len(passes)))
    slots, lengths, stages, kinds, mbs = (np.concatenate(c) for c in columns)
    return SlotGrid(slots, lengths, stages, kinds, mbs, table)


def build(
    block: Block,
    m: int,
    *,
    name: str = "custom-block",
    costs: object | None = None,
    memory_cap: float | Sequence[float] | None = None,
    options: tuple[tuple[str, object], ...] = (),
) -> Schedule:
    """A full schedule from a block: repeat for m microbatches, squeeze, reorder.

    `costs` (a `pipeblocks.sim.Costs`, default unit costs) picks among the candidate
    orders by replayed makespan and sets the memory model of the cap.
    """
    orders, _, _ = build_orders(block, m, costs=costs, memory_cap=memory_cap)
    return Schedule(name, block.p, m, block.placement, orders, options=options)


def fit_block(
    placement: Placement,
    fixed: Sequence[BlockPass],
    chain: Sequence[tuple[int, Kind, int]],
    *,
    interval: int,
    node_limit: int = 50_000,
) -> Block:
    """Complete a block by placing each (stage, kind, length) of `chain`, in order, at the
    earliest slot after its inputs whose residues mod `interval` are free on its rank.

    `fixed` passes keep their slots. A placement that leaves no room for a later pass is
    undone (depth-first search, earliest slots first), so the result is the earliest
    tiling completion in chain order; a ScheduleError if none exists.
    """
    T = interval
    S = placement.num_stages
    rank_of = placement.stage_to_rank
    used: list[set[int]] = [set() for _ in range(placement.num_ranks)]
    ends: dict[tuple[str, int], int] = {}
    for bp in fixed:
        used[rank_of[bp.stage]].update(t % T for t in range(bp.start, bp.end))
        for phase in ("B", "W") if bp.kind is Kind.BW else (bp.kind.value,):
            ends[(phase, bp.stage)] = bp.end
    placed: list[BlockPass] = []
    budget = [node_limit]

    def search(k: int) -> bool:
        if k == len(chain):
            return True
        budget[0] -= 1
        if budget[0] < 0:
            return False
        stage, kind, length = chain[k]
        rank = rank_of[stage]
        earliest = 0
        for phase, dep, _, _ in requirements(Action(stage, kind, 0), S, 1):
            if (phase, dep) not in ends:
                raise ScheduleError(f"fit_block: {stage}{kind.value} comes before its input {dep}{phase} in the chain")
            earliest = max(earliest, ends[(phase, dep)])
        for start in range(earliest, earliest + T):
            slots = {t % T for t in range(start, start + length)}
            if len(slots) < length or slots & used[rank]:
                continue
            used[rank] |= slots
            phases = ("B", "W") if kind is Kind.BW else (kind.value,)
            for phase in phases:
                ends[(phase, stage)] = start + length
            placed.append(BlockPass(stage, kind, start, length))
            if search(k + 1):
                return True
            placed.pop()
            for phase in phases:
                del ends[(phase, stage)]
            used[rank] -= slots
        return False

    if not search(0):
        raise ScheduleError(
            f"no tiling with interval T={interval} places {len(chain)} more passes after the fixed ones "
            f"({' '.join(map(str, fixed)) or 'none'}): raise the interval or move the fixed passes"
        )
    return Block(placement, tuple(fixed) + tuple(placed), interval)
