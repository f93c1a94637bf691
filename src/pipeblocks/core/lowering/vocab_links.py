"""What the vocabulary passes wait for, as keys sent and received between ranks.

The runtime moves X and the embedding output's gradient point to point (the root posts a
send to every other rank, as a pipeline send), and C0, C1 and IF's reduction are
all-reduces on a process group of their own, each issued in microbatch order on every
rank: an all-reduce is complete once every rank has issued it. Both read as keys that
one op sends (never blocking) and another receives (blocking until the send has run),
which the deadlock check and the simulator share with point-to-point transfers:

    ("X", i, r)    sent by the last stage's F(i) on its rank, received by S(i) on rank r
    ("D", i, r)    sent by stage 0's backward of i, received by IB(i) on rank r
    ("C0", i, q, r)  sent by S(i) on rank q, received by T(i) on rank r
    ("C0", i, q)   sent by S(i) on rank q, received by the last stage's backward of i
                   (one barrier: dX travels in C0)
    ("C1", i, q)   sent by T(i) on rank q, received by that backward (two barriers)
    ("IF", i, q)   sent by IF(i) on rank q, received by stage 0's F(i)

A root does not send to itself. `links` gives, per rank, for each op position that takes
part, the keys it receives before it runs and the keys it sends when it ends.
"""
from __future__ import annotations

from ..ir.actions import Action, Kind
from ..ir.program import Program
from ..ir.vocab import VocabCosts, VocabPass, roots

__all__ = ["links", "delay", "barriers_of", "key_name"]

Key = tuple


def links(program: Program, barriers: int = 1) -> list[dict[int, tuple[list[Key], list[Key]]]]:
    """Per rank: op position -> (keys received before it, keys sent after it)."""
    schedule = program.schedule
    p, last = schedule.p, schedule.num_stages - 1
    first_rank, last_rank = roots(schedule)
    out: list[dict[int, tuple[list[Key], list[Key]]]] = []
    for rank, ops in enumerate(program.ranks):
        table: dict[int, tuple[list[Key], list[Key]]] = {}
        for pos, op in enumerate(ops):
            recv: list[Key] = []
            send: list[Key] = []
            kind = type(op)
            if kind is VocabPass:
                i = op.microbatch
                if op.kind == "S":
                    if rank != last_rank:
                        recv.append(("X", i, rank))
                    send.extend(("C0", i, rank, r) for r in range(p))
                    if barriers == 1:
                        send.append(("C0", i, rank))
                elif op.kind == "T":
                    recv.extend(("C0", i, q, rank) for q in range(p))
                    if barriers == 2:
                        send.append(("C1", i, rank))
                elif op.kind == "IF":
                    send.append(("IF", i, rank))
                elif rank != first_rank:  # IB
                    recv.append(("D", i, rank))
            elif kind is Action:
                i = op.microbatch
                if op.kind is Kind.F and op.stage == last and rank == last_rank:
                    send.extend(("X", i, r) for r in range(p) if r != last_rank)
                if op.kind is Kind.F and op.stage == 0 and rank == first_rank:
                    recv.extend(("IF", i, q) for q in range(p))
                if op.kind in (Kind.B, Kind.BW):
                    if op.stage == last and rank == last_rank:
                        recv.extend((("C0", i, q) if barriers == 1 else ("C1", i, q)) for q in range(p))
                    if op.stage == 0 and rank == first_rank:
                        send.extend(("D", i, r) for r in range(p) if r != first_rank)
            if recv or send:
                table[pos] = (recv, send)
        out.append(table)
    return out


def delay(key: Key, costs: VocabCosts) -> float:
    """The time from a key's send to its arrival."""
    return {"X": costs.t_bcast, "D": costs.t_ib_bcast, "C0": costs.t_c0, "C1": costs.t_c1,
            "IF": costs.t_if_reduce}[key[0]]


def barriers_of(program: Program) -> int:
    """The barriers the Program's vocabulary passes were placed for (`vocab_place.add_vocab`
    records them as the schedule's option "vocab_barriers"; 1 otherwise)."""
    return int(program.schedule.option("vocab_barriers", 1))


def key_name(key) -> str:
    """What a key stands for, in words (the deadlock check's message)."""
    if key is None:
        return "nothing"
    if isinstance(key, tuple) and key and key[0] in ("X", "D", "C0", "C1", "IF"):
        what = {"X": "X of the last stage", "D": "the embedding gradient", "C0": "C0", "C1": "C1",
                "IF": "the embedding all-reduce"}[key[0]]
        return f"{what} of microbatch {key[1]}"
    return f"transfer {key}"
