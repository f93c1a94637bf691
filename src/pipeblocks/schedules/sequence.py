"""Sequence-level pipelining (Seq1F1B): each microbatch is cut along the sequence into k
chunks, and the chunks are the scheduling units.

`split_sequence(name, p=, m=, seq_chunks=k)` composes sequence splitting with any
registered schedule:

1. Build the base schedule for m*k virtual microbatches.
2. Forward of virtual unit u -> microbatch u // k, chunk u % k (chunks go forward in order);
   backward (B, W, BW) of virtual unit u -> microbatch u // k, chunk k-1 - u % k: backward
   is FIFO over microbatches and LIFO over chunks, because chunk c's K/V receive gradient
   from every later chunk's attention.
3. Delay the backward stream by k-1 forwards: a backward pass that had f forwards before
   it on its rank now has f + k-1, and at least k-1 more of its own stage (which matters
   when a rank holds several stages). Then every chunk of a microbatch has gone forward
   before its first backward.

A cost-aware base generator gets the mean chunk's costs (1/k of the microbatch's). For
1F1B this is Seq1F1B exactly: rank r warms up with (p-r-1) + (k-1) units and then
alternates one forward unit and one backward unit; rank 0 holds p+k-1 units of 1/k of a
microbatch each, (k+p-1)/(kp) of 1F1B's activation. Every dependency inside a rank holds
by construction; the deadlock check of `validate` covers the rest.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

from ..core.ir.actions import Action, Kind
from ..core.ir.errors import ScheduleError
from ..core.ir.schedule import Schedule
from ._build import require
from .registry import get, register

__all__ = ["split_sequence", "seq1f1b", "seq1f1b_interleaved"]


def split_sequence(name: str, *, p: int, m: int, seq_chunks: int, **options) -> Schedule:
    """Schedule `name` with every microbatch split into `seq_chunks` sequence chunks."""
    k = seq_chunks
    require(isinstance(k, int) and k >= 1, f"seq_chunks must be an integer >= 1, got {k!r}")
    spec = get(name)
    if spec.accepts("seq_chunks"):
        return spec(p=p, m=m, seq_chunks=k, **options)
    if options.get("costs") is not None:
        options["costs"] = _per_chunk(options["costs"], k)
    base = spec(p=p, m=m * k, **options)
    if base.seq_chunks != 1:
        raise ScheduleError(f"schedule {name!r} already splits sequences; it cannot be split again")
    if k == 1:
        return base
    ranks = tuple(_delay_backwards(actions, k) for actions in base.ranks)
    options_out = tuple(sorted({**dict(base.options), "seq_chunks": k}.items()))
    # the chains (DualPipe's directions) carry over; overlapped pairs run whole microbatches: dropped
    return Schedule(base.name, p, m, base.placement, ranks, seq_chunks=k, options=options_out, chains=base.chains)


def _per_chunk(costs, k: int):
    """A cost-aware base generator schedules virtual microbatches of 1/k of a sequence:
    give it the mean chunk's costs."""
    def scale(value):
        return tuple(x / k for x in value) if isinstance(value, tuple) else value / k

    return dataclasses.replace(
        costs, t_f=scale(costs.t_f), t_b=scale(costs.t_b), t_w=scale(costs.t_w), mem_b=scale(costs.mem_b),
        seq_time=None, seq_mem=None,
    )


def _relabel(action: Action, k: int) -> Action:
    mb, rest = divmod(action.microbatch, k)
    chunk = rest if action.kind is Kind.F else k - 1 - rest
    return Action(action.stage, action.kind, mb, chunk)


def _delay_backwards(actions: tuple[Action, ...], k: int) -> tuple[Action, ...]:
    forwards = [a for a in actions if a.kind is Kind.F]
    total = Counter(a.stage for a in forwards)
    seen: Counter[int] = Counter()  # forwards of each stage before the current position, in base order
    emitted: Counter[int] = Counter()
    out: list[Action] = []
    next_forward = 0
    for action in actions:
        if action.kind is Kind.F:
            seen[action.stage] += 1
            continue
        need = min(seen[action.stage] + k - 1, total[action.stage])
        before = sum(seen.values())
        need_all = min(before + k - 1, len(forwards))
        # keep the base order of forwards; run them until this stage has `need` of its own
        while next_forward < len(forwards) and (emitted[action.stage] < need or next_forward < need_all):
            forward = forwards[next_forward]
            out.append(_relabel(forward, k))
            emitted[forward.stage] += 1
            next_forward += 1
        out.append(_relabel(action, k))
    out.extend(_relabel(f, k) for f in forwards[next_forward:])
    return tuple(out)


@register("seq1f1b", "Seq1F1B: 1F1B over sequence chunks (--seq-chunks K); rank 0 holds (k+p-1)/(kp) of 1F1B")
def seq1f1b(*, p: int, m: int, seq_chunks: int = 2) -> Schedule:
    """Seq1F1B: 1F1B whose units are (microbatch, sequence chunk); backward LIFO over chunks.

    Rank r warms up with (p-r-1) + (k-1) forward units, then alternates one forward unit and
    one backward unit. Bubble (p-1)/(m*k+p-1) at equal unit costs; rank 0 holds p+k-1
    units of 1/k each. p=4, m=8, k=2 (`0F3.1` = stage 0, microbatch 3, chunk 1)::

        0: 0F0.0 0F0.1 0F1.0 0F1.1 0F2.0 0BW0.1 0F2.1 0BW0.0 0F3.0 0BW1.1 0F3.1 0BW1.0 0F4.0 0BW2.1 0F4.1 0BW2.0 0F5.0 0BW3.1 0F5.1 0BW3.0 0F6.0 0BW4.1 0F6.1 0BW4.0 0F7.0 0BW5.1 0F7.1 0BW5.0 0BW6.1 0BW6.0 0BW7.1 0BW7.0
        1: 1F0.0 1F0.1 1F1.0 1F1.1 1BW0.1 1F2.0 1BW0.0 1F2.1 1BW1.1 1F3.0 1BW1.0 1F3.1 1BW2.1 1F4.0 1BW2.0 1F4.1 1BW3.1 1F5.0 1BW3.0 1F5.1 1BW4.1 1F6.0 1BW4.0 1F6.1 1BW5.1 1F7.0 1BW5.0 1F7.1 1BW6.1 1BW6.0 1BW7.1 1BW7.0
        2: 2F0.0 2F0.1 2F1.0 2BW0.1 2F1.1 2BW0.0 2F2.0 2BW1.1 2F2.1 2BW1.0 2F3.0 2BW2.1 2F3.1 2BW2.0 2F4.0 2BW3.1 2F4.1 2BW3.0 2F5.0 2BW4.1 2F5.1 2BW4.0 2F6.0 2BW5.1 2F6.1 2BW5.0 2F7.0 2BW6.1 2F7.1 2BW6.0 2BW7.1 2BW7.0
        3: 3F0.0 3F0.1 3BW0.1 3F1.0 3BW0.0 3F1.1 3BW1.1 3F2.0 3BW1.0 3F2.1 3BW2.1 3F3.0 3BW2.0 3F3.1 3BW3.1 3F4.0 3BW3.0 3F4.1 3BW4.1 3F5.0 3BW4.0 3F5.1 3BW5.1 3F6.0 3BW5.0 3F6.1 3BW6.1 3F7.0 3BW6.0 3F7.1 3BW7.1 3BW7.0
    """
    return dataclasses.replace(split_sequence("1f1b", p=p, m=m, seq_chunks=seq_chunks), name="seq1f1b")


@register("seq1f1b-i", "interleaved Seq1F1B: interleaved 1F1B over sequence chunks and v looped chunks")
def seq1f1b_interleaved(*, p: int, m: int, v: int = 2, seq_chunks: int = 2, group_size: int | None = None) -> Schedule:
    """Interleaved Seq1F1B: interleaved 1F1B over (microbatch, sequence chunk) units, in
    groups of `group_size` units per model chunk (default p, as Seq1F1B's code does); rank r
    warms up with (v-1)G + 2(p-r-1) + (k-1) units. G = p keeps memory low but leaves a larger
    bubble than plain Seq1F1B; G = p*k (p whole microbatches per chunk round, as the
    paper's figure draws it) reaches the bubble (p-1)/(v*m*k+p-1) at about interleaved
    1F1B's memory. p=4, m=8, v=2, k=2::

        0: 0F0.0 0F0.1 0F1.0 0F1.1 4F0.0 4F0.1 4F1.0 4F1.1 0F2.0 0F2.1 0F3.0 0F3.1 4F2.0 4BW0.1 4BW0.0 4F2.1 4BW1.1 4F3.0 4BW1.0 4F3.1 0F4.0 0BW0.1 0BW0.0 0F4.1 0BW1.1 0F5.0 0BW1.0 0F5.1 4F4.0 4BW2.1 4BW2.0 4F4.1 4BW3.1 4F5.0 4BW3.0 4F5.1 0F6.0 0BW2.1 0BW2.0 0F6.1 0BW3.1 0F7.0 0BW3.0 0F7.1 4F6.0 4BW4.1 4BW4.0 4F6.1 4BW5.1 4F7.0 4BW5.0 4F7.1 0BW4.1 0BW4.0 0BW5.1 0BW5.0 4BW6.1 4BW6.0 4BW7.1 4BW7.0 0BW6.1 0BW6.0 0BW7.1 0BW7.0
        1: 1F0.0 1F0.1 1F1.0 1F1.1 5F0.0 5F0.1 5F1.0 5F1.1 1F2.0 1F2.1 1F3.0 1F3.1 5F2.0 5BW0.1 5BW0.0 5BW1.1 5BW1.0 5F2.1 5F3.0 5F3.1 1F4.0 1BW0.1 1BW0.0 1BW1.1 1BW1.0 1F4.1 1F5.0 1F5.1 5F4.0 5BW2.1 5BW2.0 5BW3.1 5BW3.0 5F4.1 5F5.0 5F5.1 1F6.0 1BW2.1 1BW2.0 1BW3.1 1BW3.0 1F6.1 1F7.0 1F7.1 5F6.0 5BW4.1 5BW4.0 5BW5.1 5BW5.0 5F6.1 1BW4.1 5F7.0 1BW4.0 5F7.1 1BW5.1 1BW5.0 5BW6.1 5BW6.0 5BW7.1 5BW7.0 1BW6.1 1BW6.0 1BW7.1 1BW7.0
        2: 2F0.0 2F0.1 2F1.0 2F1.1 6F0.0 6F0.1 6F1.0 6F1.1 6BW0.1 2F2.0 2F2.1 2F3.0 2F3.1 6F2.0 6BW0.0 6BW1.1 6BW1.0 2BW0.1 6F2.1 6F3.0 6F3.1 2F4.0 2BW0.0 2BW1.1 2BW1.0 6BW2.1 2F4.1 2F5.0 2F5.1 6F4.0 6BW2.0 6BW3.1 6BW3.0 2BW2.1 6F4.1 6F5.0 6F5.1 2F6.0 2BW2.0 2BW3.1 2BW3.0 6BW4.1 2F6.1 2F7.0 2F7.1 6F6.0 6BW4.0 6BW5.1 6BW5.0 2BW4.1 2BW4.0 6F6.1 2BW5.1 6F7.0 2BW5.0 6F7.1 6BW6.1 6BW6.0 6BW7.1 6BW7.0 2BW6.1 2BW6.0 2BW7.1 2BW7.0
        3: 3F0.0 3F0.1 3F1.0 3F1.1 7F0.0 7F0.1 7BW0.1 7F1.0 7BW0.0 7F1.1 7BW1.1 3F2.0 3F2.1 3F3.0 3F3.1 7F2.0 7BW1.0 3BW0.1 3BW0.0 3BW1.1 7F2.1 7F3.0 7F3.1 3F4.0 3BW1.0 7BW2.1 7BW2.0 7BW3.1 3F4.1 3F5.0 3F5.1 7F4.0 7BW3.0 3BW2.1 3BW2.0 3BW3.1 7F4.1 7F5.0 7F5.1 3F6.0 3BW3.0 7BW4.1 7BW4.0 7BW5.1 3F6.1 3F7.0 3F7.1 7F6.0 7BW5.0 3BW4.1 3BW4.0 3BW5.1 3BW5.0 7F6.1 7BW6.1 7F7.0 7BW6.0 7F7.1 7BW7.1 7BW7.0 3BW6.1 3BW6.0 3BW7.1 3BW7.0
    """
    schedule = split_sequence("interleaved-1f1b", p=p, m=m, seq_chunks=seq_chunks, v=v, group_size=group_size)
    return dataclasses.replace(schedule, name="seq1f1b-i")
