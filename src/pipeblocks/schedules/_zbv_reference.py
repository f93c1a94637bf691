"""The reference cost-aware ZB-V greedy (Zero Bubble Pipeline Parallelism, Qi et al. 2024), restated as the baseline to beat.

The Zero Bubble paper's V scheduler re-expressed on `Timer`. Rank i holds the down chunk
a = stage i and the up chunk z = stage 2p-1-i. Warm-up: chunk-a forwards while memory (with
room kept for the chunk-z forwards to come) and the arrival of the first chunk-z input
allow, then a staircase so each rank is at least as far as the next. Then 2m rounds: each
rank places one B (chunk z when it can, its input being ready), then one F, with pending
Ws filling waits they fit in and the "don't grow the worst bubble" rule for partial waits
(knobs fill_b, fill_f). The pass is repeated with the previous per-rank bubbles as an
approved budget while that improves. `reference_v_candidates` grid-searches the knobs.
"""
from __future__ import annotations

from itertools import product

from ..core.ir.actions import Action, Kind
from ..core.ir.placement import Placement
from ..core.cost.costs import StageCosts
from ._zb_timing import Timer, Unplaceable

__all__ = ["reference_v_candidates", "reference_v_order"]

F_, B_, W_ = Kind.F, Kind.B, Kind.W


def reference_v_candidates(p: int, m: int, table: StageCosts, limit: float):
    """Yield (knobs, ranks) for each (fill_b, fill_f) setting that completes."""
    for fill_b, fill_f in product((True, False), repeat=2):
        try:
            yield {"fill_b": fill_b, "fill_f": fill_f}, reference_v_order(p, m, table, limit, fill_b, fill_f)
        except Unplaceable:
            continue


def reference_v_order(p, m, table, limit, fill_b, fill_f) -> tuple[tuple[Action, ...], ...]:
    timer, bubbles = _attempt(p, m, table, limit, fill_b, fill_f, None)
    while True:  # re-run with the per-rank bubbles as the approved budget while it helps
        try:
            again, again_bubbles = _attempt(p, m, table, limit, fill_b, fill_f, bubbles)
        except Unplaceable:
            break
        if max(again_bubbles) >= max(bubbles):
            break
        timer, bubbles = again, again_bubbles
    return timer.ranks()


def _attempt(p, m, table, limit, fill_b, fill_f, approved):
    timer = Timer(Placement.v_shape(p), table, limit)
    down = list(range(p))
    up = [2 * p - 1 - i for i in range(p)]
    count = {key: [0] * p for key in ("Fa", "Fz", "Ba", "Bz")}
    top_approved = max(approved) if approved else 0.0

    def budget(i: int) -> float:
        worst = timer.max_bubble()
        if approved:
            worst = max(worst, top_approved - approved[i])
        return worst - timer.bubble[i]

    def put(kind: Kind, up_chunk: bool, i: int) -> None:
        stage = up[i] if up_chunk else down[i]
        key = kind.value + ("z" if up_chunk else "a")
        timer.put(kind, stage, count[key][i])
        count[key][i] += 1

    def fill(i: int, ready: float | None, partial: bool) -> None:
        if ready is None:
            return
        pending = timer.pending[i]
        while pending and ready >= timer.clock[i] + timer.cost(W_, pending[0][0]):
            timer.put_w(i)
        if pending and partial and ready - timer.clock[i] > budget(i):
            timer.put_w(i)

    # warm-up
    for i in range(p):
        put(F_, False, i)
    for i in range(p - 1, -1, -1):
        if i < p - 1:
            ready = timer.arrival(F_, up[i], 0)
            keep = timer.delta(F_, down[i]) * (2 + 2 * i)
            while (
                timer.mem[i] + keep <= timer.limit
                and timer.clock[i] + timer.cost(F_, down[i]) <= ready
                and count["Fa"][i] < m
            ):
                for j in range(i + 1):
                    put(F_, False, j)
        put(F_, True, i)
    chunk_up = False
    for i in range(1, p):
        while (
            count["Fa"][i] + count["Fz"][i] < count["Fa"][i - 1] + count["Fz"][i - 1]
            or count["Fz"][i] <= count["Fz"][i - 1] < m
        ):
            key = "Fz" if chunk_up else "Fa"
            for j in range(p - 1, i - 1, -1):
                if count[key][j] < m:
                    put(F_, chunk_up, j)
            chunk_up = not chunk_up

    for _ in range(2 * m):
        up_ranks, down_ranks = [], []
        for i in range(p):
            if count["Ba"][i] >= count["Bz"][i]:
                up_ranks.append(i)  # chunk z's backward comes first for each microbatch
            elif i == p - 1 or count["Bz"][i] >= m or timer.placed(B_, down[i] + 1, count["Ba"][i]):
                down_ranks.append(i)
            else:
                up_ranks.append(i)
        for i, up_chunk in [(i, False) for i in reversed(down_ranks)] + [(i, True) for i in up_ranks]:
            key = "Bz" if up_chunk else "Ba"
            if count[key][i] >= m:
                continue
            stage = up[i] if up_chunk else down[i]
            cross = (up_chunk and i > 0) or (not up_chunk and i < p - 1)
            ready = timer.arrival(B_, stage, count[key][i]) if cross else None
            if cross and ready is None:
                raise Unplaceable(f"{stage}B{count[key][i]} before its input")
            fill(i, ready, partial=(not up_chunk) or fill_b)
            put(B_, up_chunk, i)
        for i in range(p):
            if count["Fz"][i] >= m:
                continue
            choice = None
            if count["Fz"][i] >= count["Fa"][i]:
                choice = False
            elif i == p - 1 or timer.placed(F_, up[i] - 1, count["Fz"][i]):
                choice = True
            elif count["Fa"][i] < m and (i == 0 or timer.placed(F_, down[i] - 1, count["Fa"][i])):
                choice = False
            if choice is None:
                continue
            stage = up[i] if choice else down[i]
            while not timer.fits(F_, stage):
                timer.put_w(i)
            cross = (choice and i < p - 1) or (not choice and i > 0)
            index = count["Fz" if choice else "Fa"][i]
            ready = timer.arrival(F_, stage, index) if cross else None
            if cross and ready is None:
                raise Unplaceable(f"{stage}F{index} before its input")
            fill(i, ready, partial=fill_f)
            put(F_, choice, i)
    timer.drain()
    return timer, list(timer.bubble)
