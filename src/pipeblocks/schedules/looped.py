"""Looped placement (stage s on rank s mod p): interleaved 1F1B and breadth-first."""
from __future__ import annotations

from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ._build import BW, F, require
from .registry import register

__all__ = ["interleaved_1f1b", "breadth_first"]


def _microbatch_groups(m: int, size: int) -> list[range]:
    return [range(start, min(start + size, m)) for start in range(0, m, size)]


@register("interleaved-1f1b", "depth-first interleaved 1F1B over v looped chunks (Megatron); group size option")
def interleaved_1f1b(*, p: int, m: int, v: int = 2, group_size: int | None = None) -> Schedule:
    """Interleaved 1F1B: each rank holds v chunks; microbatches go through a chunk in groups.

    Units run in groups of `group_size` microbatches (default p): a group's forwards go
    through chunk 0, then chunk 1, ...; its backwards through chunk v-1 down to 0. Rank r
    warms up with (v-1)*G + 2(p-r-1) forward units, then alternates one forward unit and
    one backward unit. G = p is Megatron's depth-first order; G = m is breadth-first order
    inside the same 1F1B loop. When G does not divide m, the order is built for m rounded up
    to whole groups and the padding microbatches are dropped. Peak on rank 0: p + (p-1)/v stages' activations; bubble
    (p-1)/(v*m+p-1) when p divides m. p=4, m=8, v=2 (stage c*p+r on rank r)::

        0: 0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4BW0 0F7 4BW1 4F4 4BW2 4F5 4BW3 4F6 0BW0 4F7 0BW1 0BW2 0BW3 4BW4 4BW5 4BW6 4BW7 0BW4 0BW5 0BW6 0BW7
        1: 1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 5BW0 1F5 5BW1 1F6 5BW2 1F7 5BW3 5F4 1BW0 5F5 1BW1 5F6 1BW2 5F7 1BW3 5BW4 5BW5 5BW6 5BW7 1BW4 1BW5 1BW6 1BW7
        2: 2F0 2F1 2F2 2F3 6F0 6F1 6F2 6BW0 6F3 6BW1 2F4 6BW2 2F5 6BW3 2F6 2BW0 2F7 2BW1 6F4 2BW2 6F5 2BW3 6F6 6BW4 6F7 6BW5 6BW6 6BW7 2BW4 2BW5 2BW6 2BW7
        3: 3F0 3F1 3F2 3F3 7F0 7BW0 7F1 7BW1 7F2 7BW2 7F3 7BW3 3F4 3BW0 3F5 3BW1 3F6 3BW2 3F7 3BW3 7F4 7BW4 7F5 7BW5 7F6 7BW6 7F7 7BW7 3BW4 3BW5 3BW6 3BW7
    """
    require(isinstance(v, int) and v >= 1, f"v must be an integer >= 1, got {v!r}")
    group = p if group_size is None else group_size
    require(
        isinstance(group, int) and p <= group,
        f"group_size must be an integer >= p={p}, got {group!r}: smaller groups starve the pipeline; use p..m",
    )
    group = min(group, max(m, p))
    # Build for whole groups, then drop the padding microbatches: a partial last group can
    # otherwise deadlock (p=5, m=7), and the kept order is a subsequence of a valid one.
    padded = -(-m // group) * group
    forward_units = [(c, i) for g in _microbatch_groups(padded, group) for c in range(v) for i in g]
    backward_units = [(c, i) for g in _microbatch_groups(padded, group) for c in reversed(range(v)) for i in g]
    ranks = []
    for r in range(p):
        warmup = min(padded * v, (v - 1) * group + 2 * (p - r - 1))
        fwd = [F(c * p + r, i) for c, i in forward_units]
        bwd = [BW(c * p + r, i) for c, i in backward_units]
        actions = fwd[:warmup]
        for k in range(padded * v - warmup):
            actions += [fwd[warmup + k], bwd[k]]
        actions += bwd[padded * v - warmup :]
        ranks.append(tuple(a for a in actions if a.microbatch < m))
    options = (("group_size", group), ("v", v))
    return Schedule("interleaved-1f1b", p, m, Placement.loop(p, v), tuple(ranks), options=options)


@register("bfs", "looped breadth-first (BFPP): each chunk runs all microbatches before the next; peak m")
def breadth_first(*, p: int, m: int, v: int = 2) -> Schedule:
    """Looped breadth-first: rank r runs the forwards of all microbatches through chunk 0,
    then chunk 1, ...; then the backwards from chunk v-1 down to chunk 0.

    Every rank holds all m microbatches (m*v chunk activations of 1/v each): peak m.
    Bubble (p-1)/(v*m+p-1) when m >= p; with m < p each chunk round stalls.
    p=4, m=8, v=2::

        0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7 4F0 4F1 4F2 4F3 4F4 4F5 4F6 4F7 4BW0 4BW1 4BW2 4BW3 4BW4 4BW5 4BW6 4BW7 0BW0 0BW1 0BW2 0BW3 0BW4 0BW5 0BW6 0BW7
        1: 1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7 5F0 5F1 5F2 5F3 5F4 5F5 5F6 5F7 5BW0 5BW1 5BW2 5BW3 5BW4 5BW5 5BW6 5BW7 1BW0 1BW1 1BW2 1BW3 1BW4 1BW5 1BW6 1BW7
        2: 2F0 2F1 2F2 2F3 2F4 2F5 2F6 2F7 6F0 6F1 6F2 6F3 6F4 6F5 6F6 6F7 6BW0 6BW1 6BW2 6BW3 6BW4 6BW5 6BW6 6BW7 2BW0 2BW1 2BW2 2BW3 2BW4 2BW5 2BW6 2BW7
        3: 3F0 3F1 3F2 3F3 3F4 3F5 3F6 3F7 7F0 7F1 7F2 7F3 7F4 7F5 7F6 7F7 7BW0 7BW1 7BW2 7BW3 7BW4 7BW5 7BW6 7BW7 3BW0 3BW1 3BW2 3BW3 3BW4 3BW5 3BW6 3BW7
    """
    require(isinstance(v, int) and v >= 1, f"v must be an integer >= 1, got {v!r}")
    ranks = []
    for r in range(p):
        forwards = [F(c * p + r, i) for c in range(v) for i in range(m)]
        backwards = [BW(c * p + r, i) for c in reversed(range(v)) for i in range(m)]
        ranks.append(tuple(forwards + backwards))
    return Schedule("bfs", p, m, Placement.loop(p, v), tuple(ranks), options=(("v", v),))
