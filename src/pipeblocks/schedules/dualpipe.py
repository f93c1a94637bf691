"""DualPipe and DualPipeV (DeepSeek-V3, section 3.2.1): overlapped forward-backward pairs;
DualPipeV is DualPipe cut in half, on the V placement (rank r holds stages r and 2p-1-r).

    pipeblocks simulate dualpipev -p 4 -m 8
    pipeblocks simulate dualpipe -p 4 -m 8
    pipeblocks compare --schedules zb-v,v-zb,dualpipev,dualpipe -p 4 -m 16

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

DualPipe runs the same program on p ranks (p even) in two directions, m/2 microbatches
each: rank r holds model stage r for the microbatches entering at rank 0 and model stage
p-1-r for those entering at rank p-1. In the IR that is two chains (`Schedule.chains`) on
the V placement of p ranks: stages 0..p-1 are the first direction (stage s on rank s),
stages p..2p-1 the second (stage p+j is model stage j, on rank p-1-j), microbatches
0..m/2-1 go down the first, m/2..m-1 down the second. Rank r < p/2 runs DualPipeV's program
of rank r (p/2 ranks, m/2 microbatches) with chunk 0 its first-direction stage; a rank of
the second half runs that of rank p-1-r with the directions swapped; the two middle ranks
turn around over the link instead of locally. Every model stage has two copies (stage j
and p+j), whose gradients are summed before the optimizer step. It needs p even, m even
and m >= 2p; its makespan at equal costs is 3m + p - 2 full-stage passes, and each rank
holds p+1 full-stage activations at its peak (DualPipeV: the same program on half the
ranks, without the copies).
"""
from __future__ import annotations

from collections import deque

from ..core.ir.actions import Action
from ..core.ir.errors import ScheduleError
from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ._build import B, BW, F, W
from .registry import register

__all__ = ["dualpipe", "dualpipev", "dualpipev_orders", "dualpipe_orders", "check_dualpipe", "check_dualpipev"]


def check_dualpipev(p: int, m: int) -> None:
    """One line naming the numbers and the nearest valid m, before anything is built."""
    if m < 2 * p:
        raise ScheduleError(
            f"dualpipev needs m >= 2p microbatches: p={p} takes m >= {2 * p}, got m={m}; "
            f"use -m {2 * p} (the nearest valid m)"
        )


def check_dualpipe(p: int, m: int) -> None:
    """One line naming the numbers and the fix, before anything is built."""
    if p % 2:
        raise ScheduleError(
            f"dualpipe needs an even p (each rank pairs with rank p-1-r), got p={p}; use -p {p - 1} or -p {p + 1}, "
            "or dualpipev, which takes any p"
        )
    if m % 2 or m < 2 * p:
        valid = max(2 * p, m + m % 2)
        raise ScheduleError(
            f"dualpipe needs an even m >= 2p (m/2 microbatches enter from each end): p={p} takes m = {2 * p}, "
            f"{2 * p + 2}, ...; got m={m}; use -m {valid} (the nearest valid m)"
        )


class _Rank:
    """One rank's program as it is written: counters per chunk, the weight FIFO, the list.
    stages: the chunks' stages; offsets: the first microbatch of each chunk's stream."""

    def __init__(self, stages: tuple[int, int], offsets: tuple[int, int] = (0, 0)) -> None:
        self.stage = stages
        self.offset = offsets
        self.forwards = [0, 0]
        self.backwards = [0, 0]
        self.queue: deque[Action] = deque()  # weight gradients owed, oldest first
        self.out: list[Action] = []
        self.overlapped: set[Action] = set()

    def forward(self, chunk: int) -> Action:
        action = F(self.stage[chunk], self.offset[chunk] + self.forwards[chunk])
        self.forwards[chunk] += 1
        self.out.append(action)
        return action

    def backward(self, chunk: int, split: bool = False) -> None:
        stage, mb = self.stage[chunk], self.offset[chunk] + self.backwards[chunk]
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


def _program(k: _Rank, p: int, r: int, m: int) -> _Rank:
    """DeepSeek's eight steps for rank r of p (DualPipeV's numbering), m microbatches per chunk."""
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
        raise AssertionError(f"rank {r}: the eight steps left {k.forwards}, {k.backwards}, {k.queue}")
    return k


def dualpipev_orders(p: int, m: int) -> tuple[tuple[tuple[Action, ...], ...], frozenset[Action]]:
    """Every rank's actions and the overlapped forwards (`Schedule.overlapped`)."""
    check_dualpipev(p, m)
    ranks = [_program(_Rank((r, 2 * p - 1 - r)), p, r, m) for r in range(p)]
    return tuple(tuple(k.out) for k in ranks), frozenset().union(*(k.overlapped for k in ranks))


def dualpipe_orders(p: int, m: int) -> tuple[tuple[tuple[Action, ...], ...], frozenset[Action]]:
    """DualPipe's per-rank actions on the two-chain V placement (module docstring)."""
    check_dualpipe(p, m)
    half, per = p // 2, m // 2
    ranks = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r  # first direction's stage, second direction's stage
        if r < half:
            k = _Rank((down, up), (0, per))
        else:  # the second half runs the program of rank p-1-r, starting with the second direction
            k = _Rank((up, down), (per, 0))
        ranks.append(_program(k, half, min(r, p - 1 - r), per))
    return tuple(tuple(k.out) for k in ranks), frozenset().union(*(k.overlapped for k in ranks))


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


@register("dualpipe", "DeepSeek's bidirectional DualPipe: p even, m/2 from each end, stages copied; m >= 2p", v=2)
def dualpipe(*, p: int, m: int) -> Schedule:
    """DualPipe (DeepSeek-V3): microbatches enter from both ends, m/2 each; rank r holds
    model stage r for one direction and p-1-r for the other (stages 0..p-1 and p..2p-1 of
    two chains, stage p+j a copy of model stage j). Needs p even, m even, m >= 2p. At p=2, m=4::

        0: 0F0 3F2 0F1 3BW2 3F3&0BW0 3BW3 0B1 0W1
        1: 2F2 1F0 2F3 1BW0 1F1&2BW2 1BW1 2B3 2W3
    """
    ranks, overlapped = dualpipe_orders(p, m)
    return Schedule("dualpipe", p, m, Placement.v_shape(p), ranks, overlapped=overlapped, chains=2)
