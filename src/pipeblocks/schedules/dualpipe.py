"""DualPipeV: DeepSeek's DualPipe cut in half, on the V placement (rank r holds stages r and
2p-1-r), with overlapped forward-backward pairs.

    pipeblocks simulate dualpipev -p 4 -m 8
    pipeblocks compare zb-v v-zb dualpipev -p 4 -m 16

Each rank runs the same eight-step program, built from five building blocks: F (forward),
I (input-gradient backward, `B` here), W (the oldest queued weight gradient, FIFO over both
chunks), B (fused backward, `BW` here) and the pair F&B (a forward overlapped with another
microbatch's fused backward, one op: `0F3&3BW1`). Chunk 0 is stage r, chunk 1 stage 2p-1-r:

    step  repeats        body
    1     2(p-r-1)       F0
    2     r+1            F0 F1
    3     p-r-1          I1 W F1
    4     m-2p+r+1       F0&B1  F1&B0   (the last rank runs its first F0&B1 as F0 then B1)
    5     p-r-1          B1  F1&B0
    6     r+1            B1 B0          (the later half as I1 I0: from iteration (r+1)//2,
                                         before B1 on odd ranks, between B1 and B0 on even)
    7     p-r-1          W I0
    8     r+1            W

At p = 2, m = 4 this gives, in pipeblocks' text form::

    0: 0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3&3BW1 3F2&0BW0 3BW2 3F3&0BW1 3BW3 0B2 0W2 0B3 0W3
    1: 1F0 2F0 1F1 2F1 1F2 2BW0 2F2&1BW0 1F3&2BW1 2F3&1BW1 2BW2 1BW2 2B3 1B3 2W3 1W3

At equal costs (F = B = W, no overlap gain) its makespan is 6m + 2(p-1) slots of one chunk
pass, against ZB-V's 6m + p - 1, and every rank holds 2p+1 chunk activations at its peak
against ZB-V's 2p: it pays off only where a pair hides communication (`Costs.overlap`).
It needs m >= 2p.
"""
from __future__ import annotations

from collections import deque

from ..core.actions import Action
from ..core.errors import ScheduleError
from ..core.placement import Placement
from ..core.schedule import Schedule
from ._build import B, BW, F, W
from .registry import register

__all__ = ["dualpipev", "dualpipev_orders", "check_dualpipev"]


def check_dualpipev(p: int, m: int) -> None:
    """One line naming the numbers and the nearest valid m, before anything is built."""
    if m < 2 * p:
        raise ScheduleError(
            f"dualpipev needs m >= 2p microbatches: p={p} takes m >= {2 * p}, got m={m}; "
            f"use -m {2 * p} (the nearest valid m)"
        )


class _Rank:
    """One rank's program as it is written: counters per chunk, the weight FIFO, the list."""

    def __init__(self, p: int, r: int) -> None:
        self.stage = (r, 2 * p - 1 - r)
        self.forwards = [0, 0]
        self.backwards = [0, 0]
        self.queue: deque[Action] = deque()  # weight gradients owed, oldest first
        self.out: list[Action] = []
        self.overlapped: set[Action] = set()

    def forward(self, chunk: int) -> Action:
        action = F(self.stage[chunk], self.forwards[chunk])
        self.forwards[chunk] += 1
        self.out.append(action)
        return action

    def backward(self, chunk: int, split: bool = False) -> None:
        stage, mb = self.stage[chunk], self.backwards[chunk]
        self.backwards[chunk] += 1
        if split:
            self.out.append(B(stage, mb))
            self.queue.append(W(stage, mb))
        else:
            self.out.append(BW(stage, mb))

    def weight(self) -> None:
        self.out.append(self.queue.popleft())

    def pair(self, forward_chunk: int, backward_chunk: int) -> None:
        self.overlapped.add(self.forward(forward_chunk))
        self.backward(backward_chunk)


def dualpipev_orders(p: int, m: int) -> tuple[tuple[tuple[Action, ...], ...], frozenset[Action]]:
    """Every rank's actions and the overlapped forwards (`Schedule.overlapped`)."""
    check_dualpipev(p, m)
    ranks, overlapped = [], set()
    for r in range(p):
        k = _Rank(p, r)
        for _ in range(2 * (p - r - 1)):  # 1: chunk-0 forwards
            k.forward(0)
        for _ in range(r + 1):  # 2: both chunks' forwards
            k.forward(0)
            k.forward(1)
        for _ in range(p - r - 1):  # 3: chunk 1's first backwards, split
            k.backward(1, split=True)
            k.weight()
            k.forward(1)
        for i in range(m - 2 * p + r + 1):  # 4: the overlapped steady state
            if i == 0 and r == p - 1:
                k.forward(0)
                k.backward(1)
            else:
                k.pair(0, 1)
            k.pair(1, 0)
        for _ in range(p - r - 1):  # 5
            k.backward(1)
            k.pair(1, 0)
        split, half = False, (r + 1) // 2
        for i in range(r + 1):  # 6: the later half split, to fill the cool-down with weights
            if i == half and r % 2 == 1:
                split = True
            k.backward(1, split)
            if i == half and r % 2 == 0:
                split = True
            k.backward(0, split)
        for _ in range(p - r - 1):  # 7
            k.weight()
            k.backward(0, split=True)
        for _ in range(r + 1):  # 8
            k.weight()
        if k.queue or k.forwards != [m, m] or k.backwards != [m, m]:
            raise AssertionError(f"dualpipev rank {r}: the eight steps left {k.forwards}, {k.backwards}, {k.queue}")
        ranks.append(tuple(k.out))
        overlapped |= k.overlapped
    return tuple(ranks), frozenset(overlapped)


@register("dualpipev", "DeepSeek's DualPipe cut in half: V placement, overlapped F&B pairs; m >= 2p", v=2)
def dualpipev(*, p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe, cut in half): the V placement, two chunks per
    rank, one forward overlapped with another microbatch's backward in the steady state.
    Needs m >= 2p. At equal costs it does not beat zb-v; it wins where a pair hides
    communication (`Costs.overlap`). At p=2, m=4::

        0: 0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3&3BW1 3F2&0BW0 3BW2 3F3&0BW1 3BW3 0B2 0W2 0B3 0W3
        1: 1F0 2F0 1F1 2F1 1F2 2BW0 2F2&1BW0 1F3&2BW1 2F3&1BW1 2BW2 1BW2 2B3 1B3 2W3 1W3
    """
    ranks, overlapped = dualpipev_orders(p, m)
    return Schedule("dualpipev", p, m, Placement.v_shape(p), ranks, overlapped=overlapped)
