"""Handcrafted zero-bubble schedules (ZB paper): ZB-H1 and ZB-H2, split backward, loop placement.

Both run the 1F1B skeleton with the backward split into B (input gradient, on the
critical path) and W (weight gradient, off it), and defer each stage's Ws to fill the
bubbles that 1F1B leaves. "Bubble" in the closed forms below is the ZB paper's: the idle
time inside the worst rank's span (first pass to last pass), which is what a training loop
without a cross-stage sync at the step boundary pays per step. The simulator's
`bubble_ratio` measures against the global makespan instead, which for any schedule on
loop placement also counts the (p-1)*T_F head start of rank 0 over rank p-1.
"""
from __future__ import annotations

from ..core.ir.actions import Action
from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ._build import B, F, W
from .registry import register

__all__ = ["zb_h1", "zb_h2", "lagged_w_program"]


def lagged_w_program(stage: int, m: int, warmup: int, lag: int) -> tuple[Action, ...]:
    """One stage's program: `warmup` forwards, then (B, W if more than `lag` Ws wait, F)
    while forwards remain, then the remaining Bs under the same W rule, then all Ws."""
    warmup = min(m, warmup)
    actions = [F(stage, i) for i in range(warmup)]
    next_f, next_b, next_w = warmup, 0, 0
    while next_b < m:
        actions.append(B(stage, next_b))
        next_b += 1
        if next_b - next_w > lag:
            actions.append(W(stage, next_w))
            next_w += 1
        if next_f < m:
            actions.append(F(stage, next_f))
            next_f += 1
    actions += [W(stage, i) for i in range(next_w, m)]
    return tuple(actions)


@register("zb-h1", "zero-bubble H1: 1F1B order with B/W split, stage s defers W by s; 1F1B peak, bubble 1/3 of 1F1B's")
def zb_h1(*, p: int, m: int) -> Schedule:
    """ZB-H1: stage s warms up with min(m, p-s) forwards like 1F1B, then runs B, W, F with
    its Ws lagging its Bs by s microbatches; the deferred Ws fill the cool-down bubble.

    Peak activation p*M_B on stage 0, as 1F1B (stage s holds (p-s)*M_B + s*M_W).
    Bubble (p-1)*(T_F+T_B-T_W) for m >= p and T_W <= T_F (the paper's setting), against
    1F1B's (p-1)*(T_F+T_B+T_W): at equal costs a rate of (p-1)/(3m+p-1). Any m >= 1 runs
    (m < p only shortens the warm-up). p=4, m=8::

        0: 0F0 0F1 0F2 0F3 0B0 0W0 0F4 0B1 0W1 0F5 0B2 0W2 0F6 0B3 0W3 0F7 0B4 0W4 0B5 0W5 0B6 0W6 0B7 0W7
        1: 1F0 1F1 1F2 1B0 1F3 1B1 1W0 1F4 1B2 1W1 1F5 1B3 1W2 1F6 1B4 1W3 1F7 1B5 1W4 1B6 1W5 1B7 1W6 1W7
        2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2W0 2F4 2B3 2W1 2F5 2B4 2W2 2F6 2B5 2W3 2F7 2B6 2W4 2B7 2W5 2W6 2W7
        3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4 3B4 3W1 3F5 3B5 3W2 3F6 3B6 3W3 3F7 3B7 3W4 3W5 3W6 3W7
    """
    ranks = tuple(lagged_w_program(s, m, warmup=p - s, lag=s) for s in range(p))
    return Schedule("zb-h1", p, m, Placement.loop(p), ranks)


@register("zb-h2", "zero-bubble H2: 2(p-s)-1 warm-up forwards, W lag 2s; zero bubble at equal costs, peak (2p-1)")
def zb_h2(*, p: int, m: int) -> Schedule:
    """ZB-H2: stage s warms up with min(m, 2(p-s)-1) forwards, then runs B, W, F with its
    Ws lagging its Bs by 2s microbatches. The timeline is a parallelogram: every rank is
    busy from its first pass to its last.

    Peak activation (2p-1)*M_B (stage s holds (2p-2s-1)*M_B + 2s*M_W).
    Bubble max(0, (p-1)*(T_F+T_B-2*T_W)) for m >= 2p-1: zero at equal costs. Any m >= 1
    runs; below 2p-1 the warm-up is cut short and the bubble grows. p=4, m=8::

        0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0B0 0W0 0F7 0B1 0W1 0B2 0W2 0B3 0W3 0B4 0W4 0B5 0W5 0B6 0W6 0B7 0W7
        1: 1F0 1F1 1F2 1F3 1F4 1B0 1F5 1B1 1F6 1B2 1W0 1F7 1B3 1W1 1B4 1W2 1B5 1W3 1B6 1W4 1B7 1W5 1W6 1W7
        2: 2F0 2F1 2F2 2B0 2F3 2B1 2F4 2B2 2F5 2B3 2F6 2B4 2W0 2F7 2B5 2W1 2B6 2W2 2B7 2W3 2W4 2W5 2W6 2W7
        3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3W0 3F7 3B7 3W1 3W2 3W3 3W4 3W5 3W6 3W7
    """
    ranks = tuple(lagged_w_program(s, m, warmup=2 * (p - s) - 1, lag=2 * s) for s in range(p))
    return Schedule("zb-h2", p, m, Placement.loop(p), ranks)
