"""The reference ZB greedy (Zero Bubble Pipeline Parallelism, Qi et al. 2024), restated here as the baseline to beat.

This is the heuristic of the Zero Bubble paper's code, re-expressed on `Timer`, one stage
per rank (loop placement). It is kept as its own mode so that the cost-aware generator in
`zb_greedy` can be compared with it on the same inputs; it is not the shipped default.

Per microbatch i, each stage normally adds one F (top-down) and one B (bottom-up), with
pending Ws run (a) when memory requires, (b) to fill a wait for a cross-stage input they
fit in, (c) for a partial wait, by the "don't grow the worst bubble" rule. Microbatch 0
counts the warm-up forwards each stage can run before B(0) reaches it. Three knobs, grid
searched by `reference_candidates`: allow_bubble_before_first_b, prioritize_b,
no_bubble_greedy.
"""
from __future__ import annotations

from itertools import product

from ..core.ir.actions import Action, Kind
from ..core.ir.placement import Placement
from ..core.cost.costs import StageCosts
from ._zb_timing import Timer, Unplaceable

__all__ = ["reference_order", "reference_candidates", "KNOBS"]

KNOBS = ("allow_bubble_before_first_b", "prioritize_b", "no_bubble_greedy")
F_, B_, W_ = Kind.F, Kind.B, Kind.W


def reference_candidates(p: int, m: int, table: StageCosts, limit: float):
    """Yield (knobs, ranks) for every knob setting that completes (failures are skipped)."""
    for values in product((True, False), repeat=3):
        knobs = dict(zip(KNOBS, values))
        try:
            yield knobs, reference_order(p, m, table, limit, **knobs)
        except Unplaceable:
            continue


def reference_order(
    p: int, m: int, table: StageCosts, limit: float, *,
    allow_bubble_before_first_b: bool, prioritize_b: bool, no_bubble_greedy: bool,
) -> tuple[tuple[Action, ...], ...]:
    timer = Timer(Placement.loop(p), table, limit)
    comm = table.t_comm
    nf = [0] * p  # forwards placed per stage
    nb = [0] * p

    def put(kind: Kind, stage: int) -> None:
        if kind is F_:
            timer.put(F_, stage, nf[stage])
            nf[stage] += 1
        elif kind is B_:
            timer.put(B_, stage, nb[stage])
            nb[stage] += 1
        else:
            timer.put_w(stage)

    def cost(kind: Kind, stage: int) -> float:
        return timer.cost(kind, stage)

    def free_for(kind: Kind, stage: int) -> None:
        while not timer.fits(kind, stage):
            put(W_, stage)  # raises Unplaceable when no W is pending: "cannot fit memory"

    def fill_wait(stage: int, ready: float) -> None:
        """Run pending Ws while they fit before `ready`; then the partial-gap rule."""
        pending = timer.pending[stage]
        while pending and timer.clock[stage] + cost(W_, pending[0][0]) <= ready:
            put(W_, stage)
        if pending and timer.clock[stage] < ready:
            within_budget = ready - timer.clock[stage] <= timer.max_bubble() - timer.bubble[stage]
            if no_bubble_greedy or not within_budget:
                put(W_, stage)

    # microbatch 0: one F everywhere, then the warm-up forwards each stage can afford
    for j in range(p):
        put(F_, j)
    extra = [0] * p
    last_t = timer.end[(F_, p - 1, 0)] + cost(B_, p - 1)
    for j in range(p - 2, -1, -1):
        mem, clock = timer.mem[j], timer.clock[j]
        while nf[j] + extra[j] < m and mem + timer.delta(F_, j) <= timer.limit:
            if allow_bubble_before_first_b:
                if clock + cost(F_, j) > last_t + comm:
                    break
            elif clock >= last_t + comm:
                break
            mem += timer.delta(F_, j)
            clock += cost(F_, j)
            extra[j] += 1
        last_t = max(clock, last_t + comm) + cost(B_, j)
    for j in range(1, p):  # staircase: a stage runs fewer warm-up forwards than the one before
        while extra[j] > 0 and extra[j] >= extra[j - 1] and nf[j] + extra[j] < m:
            extra[j] -= 1
    for j in range(p):
        for _ in range(extra[j]):
            put(F_, j)
    for j in range(p - 1, -1, -1):
        put(B_, j)

    for i in range(1, m):
        want = [0] * p
        for j in range(p):
            if nf[j] >= m:
                continue
            want[j] = 1
            if prioritize_b and j + 1 < p and nf[j] >= nf[j + 1] + 2:
                next_b_ready = (
                    timer.clock[j + 1] + cost(F_, j + 1) + cost(B_, j + 1) + comm
                )
                if timer.clock[j] >= next_b_ready:
                    want[j] = 0
                    continue
                # Ws that memory would force before this F
                mem, w_time, queue = timer.mem[j] + timer.delta(F_, j), 0.0, list(timer.pending[j])
                while mem > timer.limit and queue:
                    stage, _ = queue.pop(0)
                    w_time += cost(W_, stage)
                    mem += timer.delta(W_, stage)
                if timer.clock[j] + cost(F_, j) + w_time <= next_b_ready:
                    continue
                if next_b_ready - timer.clock[j] <= timer.max_bubble() - timer.bubble[j]:
                    want[j] = 0
        for j in range(p - 2, -1, -1):
            want[j] = min(want[j], want[j + 1])
        for j in range(p):
            if not want[j]:
                continue
            free_for(F_, j)
            if j > 0:
                ready = timer.arrival(F_, j, nf[j])
                if ready is None:
                    raise Unplaceable(f"{j}F{nf[j]} before its input")
                fill_wait(j, ready)
            put(F_, j)
        for j in range(p - 1, -1, -1):
            free_for(B_, j)
            if j + 1 < p:
                ready = timer.arrival(B_, j, i)
                if ready is None:
                    raise Unplaceable(f"{j}B{i} before its input")
                fill_wait(j, ready)
            if j == 0 and nf[0] == m:
                while timer.pending[0]:
                    put(W_, 0)
            put(B_, j)
    timer.drain()
    return timer.ranks()
