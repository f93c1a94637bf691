"""GPipe and 1F1B: one stage per rank, fused backward."""
from __future__ import annotations

from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ._build import BW, F
from .registry import register

__all__ = ["gpipe", "one_f_one_b", "one_f_one_b_recompute"]


@register("gpipe", "all forwards, then all backwards; peak m on every rank")
def gpipe(*, p: int, m: int) -> Schedule:
    """GPipe: every rank runs the forward of all m microbatches, then all backwards.

    Bubble (p-1)/(m+p-1) with fused backward; every rank holds all m activations.
    p=4, m=8::

        0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7 0BW0 0BW1 0BW2 0BW3 0BW4 0BW5 0BW6 0BW7
        1: 1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7 1BW0 1BW1 1BW2 1BW3 1BW4 1BW5 1BW6 1BW7
        2: 2F0 2F1 2F2 2F3 2F4 2F5 2F6 2F7 2BW0 2BW1 2BW2 2BW3 2BW4 2BW5 2BW6 2BW7
        3: 3F0 3F1 3F2 3F3 3F4 3F5 3F6 3F7 3BW0 3BW1 3BW2 3BW3 3BW4 3BW5 3BW6 3BW7
    """
    ranks = tuple(
        tuple(F(r, i) for i in range(m)) + tuple(BW(r, i) for i in range(m)) for r in range(p)
    )
    return Schedule("gpipe", p, m, Placement.loop(p), ranks)


@register("1f1b", "one forward, one backward in the steady state; peak p on rank 0")
def one_f_one_b(*, p: int, m: int) -> Schedule:
    """1F1B: warm up with p-r-1 forwards, alternate F and BW, cool down with the backwards.

    Rank r holds at most min(m, p-r) activations; bubble (p-1)/(m+p-1) with fused backward.
    p=4, m=8::

        0: 0F0 0F1 0F2 0F3 0BW0 0F4 0BW1 0F5 0BW2 0F6 0BW3 0F7 0BW4 0BW5 0BW6 0BW7
        1: 1F0 1F1 1F2 1BW0 1F3 1BW1 1F4 1BW2 1F5 1BW3 1F6 1BW4 1F7 1BW5 1BW6 1BW7
        2: 2F0 2F1 2BW0 2F2 2BW1 2F3 2BW2 2F4 2BW3 2F5 2BW4 2F6 2BW5 2F7 2BW6 2BW7
        3: 3F0 3BW0 3F1 3BW1 3F2 3BW2 3F3 3BW3 3F4 3BW4 3F5 3BW5 3F6 3BW6 3F7 3BW7
    """
    ranks = []
    for r in range(p):
        warmup = min(m, p - r - 1)
        actions = [F(r, i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [F(r, warmup + i), BW(r, i)]
        actions += [BW(r, i) for i in range(m - warmup, m)]
        ranks.append(tuple(actions))
    return Schedule("1f1b", p, m, Placement.loop(p), tuple(ranks))


@register("1f1b-r", "1F1B with full recomputation: every forward keeps its input only; peak ~ p inputs + one activation")
def one_f_one_b_recompute(*, p: int, m: int) -> Schedule:
    """1F1B with full recomputation, the classic memory-saving baseline: the order of
    `1f1b`, and lowering adds a RECOMPUTE before every backward (the schedule's option
    recompute="all"), so each forward keeps only its stage input (a share r of M_B,
    `Costs.recompute_input_ratio`) and the recomputation rebuilds the rest just before
    the backward. Rank r peaks at min(m, p-r)*r*M_B + (1-r)*M_B, about r*p + 1 stage
    activations on rank 0, for one extra forward per (stage, microbatch).
    p=2, m=2::

        0: 0F0 0F1 0BW0 0BW1
        1: 1F0 1BW0 1F1 1BW1

    lowered (`2R5` re-runs stage 2's forward of microbatch 5)::

        0: 0F0 0SEND_F0 0F1 0SEND_F1 0R0 0RECV_B0 0BW0 0R1 0RECV_B1 0BW1
        1: 1RECV_F0 1F0 1R0 1BW0 1SEND_B0 1RECV_F1 1F1 1R1 1BW1 1SEND_B1
    """
    base = one_f_one_b(p=p, m=m)
    return Schedule("1f1b-r", p, m, base.placement, base.ranks, options=(("recompute", "all"),))
