"""Vocabulary parallelism in the IR: the vocabulary passes, their costs and their check.

Vocabulary Parallelism (Yeung, Qi, Lin, Wan, MLSys 2025) partitions the input embedding
and the output layer (head plus softmax cross entropy) by vocabulary over all p pipeline
ranks. The last stage's forward then ends at the final norm (its output X), stage 0's
forward starts from the embedding output, and four passes per microbatch run on EVERY
rank, each on the rank's V/p rows::

    IF5   input embedding forward of microbatch 5: the rank's rows, zeros elsewhere;
          then an all-reduce (sum) whose result stage 0's 0F5 consumes
    S5    output layer, first pass: X of microbatch 5 is broadcast from the rank holding
          the last stage; the rank's logits shard and its softmax statistics (and, with
          one barrier, its part of dX); then the all-reduce C0
    T5    output layer, second pass: the weight gradient of the rank's rows once C0 is
          in (with two barriers, also its dX part, then the all-reduce C1)
    IB5   input embedding backward: the gradient of the embedding output is broadcast from
          the rank holding stage 0 after its backward; the rank accumulates its rows'

The collectives run on the communication stream, issued in one order on every rank, and
are waited on only by the op that needs their result: T5 and (one barrier) the last
stage's backward wait for C0, the last stage's backward waits for C1 (two barriers), 0F5
waits for IF5's all-reduce, S5 waits for X and IB5 for the embedding gradient.

A lowered Program with vocabulary parallelism, 1F1B at p=2, m=2 (`vocab_place.add_vocab`,
which here kept the schedule with one more microbatch in flight)::

    0: IF0 IF1 0F0 0SEND_F0 0F1 0SEND_F1 S0 T0 S1 T1 0RECV_B0 0BW0 0RECV_B1 0BW1 IB0 IB1
    1: IF0 IF1 1RECV_F0 1F0 S0 1RECV_F1 1F1 1BW0 1SEND_B0 T0 S1 T1 1BW1 1SEND_B1 IB0 IB1

Every rank holds exactly one IF, S, T and IB per microbatch, S before T, and the
sequence of these ops is the same on every rank (`check_vocab`); on the rank holding the
last stage S(i) follows F(last, i) and precedes that stage's backward of i (T(i) too with
two barriers); on the rank holding stage 0, IF(i) precedes F(0, i) and IB(i) follows its
backward of i.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import NamedTuple

from .actions import Action, Kind
from .errors import ScheduleError

__all__ = ["VOCAB_KINDS", "VocabPass", "VocabCosts", "VOCAB_RE", "check_vocab", "roots"]

VOCAB_KINDS = ("IF", "S", "T", "IB")
VOCAB_RE = re.compile(r"(IF|IB|S|T)(\d+)")


class VocabPass(NamedTuple):
    """One vocabulary pass (`kind` in VOCAB_KINDS) of `microbatch`, run on every rank."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class VocabCosts:
    """Per rank and per microbatch (every rank holds V/p rows; the same on each):

    t_s, t_t: the output layer's S and T passes.  t_if, t_ib: the input embedding's.
    t_bcast: broadcast of X before S.  t_c0: the all-reduce C0 after S.  t_c1: the
    all-reduce C1 after T (two barriers only).  t_if_reduce: the all-reduce of IF's output.
    t_ib_bcast: broadcast of the embedding output's gradient before IB.
    mem_st: activation every rank holds from S to T (the embedding output IF makes is stage
    0's input, counted in its forward's activation).  params: parameters of the vocabulary rows a rank
    holds (embedding and head: 2*V*h/p, or V*h/p when tied), for its static memory.
    barriers: 1 (Algorithm 2: dX travels in C0) or 2 (Algorithm 1: dX in C1).
    """

    t_s: float = 0.0
    t_t: float = 0.0
    t_if: float = 0.0
    t_ib: float = 0.0
    t_bcast: float = 0.0
    t_c0: float = 0.0
    t_c1: float = 0.0
    t_if_reduce: float = 0.0
    t_ib_bcast: float = 0.0
    mem_st: float = 0.0
    params: float = 0.0
    barriers: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ScheduleError(f"vocabulary cost {f.name} must be a finite number >= 0, got {value!r}")
        if self.barriers not in (1, 2):
            raise ScheduleError(f"vocabulary barriers must be 1 (Algorithm 2) or 2 (Algorithm 1), got {self.barriers}")

    def duration(self, kind: str) -> float:
        return {"IF": self.t_if, "S": self.t_s, "T": self.t_t, "IB": self.t_ib}[kind]


def roots(schedule) -> tuple[int, int]:
    """(rank holding stage 0, rank holding the last stage): the roots of IF's consumer and
    IB's broadcast, and of S's broadcast."""
    rank_of = schedule.placement.stage_to_rank
    return rank_of[0], rank_of[schedule.num_stages - 1]


def check_vocab(program, barriers: int = 1) -> None:
    """Raise ScheduleError unless every rank runs one IF, S, T and IB per microbatch, in
    the same order on every rank, S(i) before T(i), and the roots order them around
    their stage's passes (the module docstring)."""
    schedule = program.schedule
    m, last = schedule.m, schedule.num_stages - 1
    first_rank, last_rank = roots(schedule)
    if schedule.seq_chunks != 1:
        raise ScheduleError(
            f"vocabulary parallelism runs whole microbatches, but schedule {schedule.name!r} splits each into "
            f"{schedule.seq_chunks} sequence chunks: use a schedule without sequence chunks"
        )
    sequences = [tuple(op for op in ops if type(op) is VocabPass) for ops in program.ranks]
    for rank, seq in enumerate(sequences):
        counts = {(op.kind, op.microbatch) for op in seq}
        if len(counts) != len(seq) or len(seq) != 4 * m:
            missing = [f"{k}{i}" for i in range(m) for k in VOCAB_KINDS if (k, i) not in counts]
            raise ScheduleError(
                f"rank {rank} holds {len(seq)} vocabulary passes, not one IF, S, T and IB for each of the m={m} "
                f"microbatches ({4 * m})" + (f"; missing {' '.join(missing[:4])}" if missing else "; some run twice")
                + ": lower with vocab_place.add_vocab"
            )
        if seq != sequences[0]:
            at = next(k for k, (a, b) in enumerate(zip(seq, sequences[0])) if a != b)
            raise ScheduleError(
                f"rank {rank} runs vocabulary pass {seq[at]} where rank 0 runs {sequences[0][at]} (its pass {at}): "
                "every rank must issue the vocabulary collectives in the same order, or they deadlock"
            )
    seen_s: set[int] = set()
    for op in sequences[0]:
        if op.kind == "S":
            seen_s.add(op.microbatch)
        elif op.kind == "T" and op.microbatch not in seen_s:
            raise ScheduleError(f"T{op.microbatch} runs before S{op.microbatch}: T needs S's statistics; move it after")
    _check_root(program.ranks[last_rank], last_rank, lambda op, i: _is(op, Kind.F, last, i), "S", "after",
                f"{last}F")
    needs = ("S",) if barriers == 1 else ("S", "T")
    for kind in needs:
        _check_root(program.ranks[last_rank], last_rank, lambda op, i: _is_backward(op, last, i), kind, "before",
                    f"{last}B")
    _check_root(program.ranks[first_rank], first_rank, lambda op, i: _is(op, Kind.F, 0, i), "IF", "before", "0F")
    _check_root(program.ranks[first_rank], first_rank, lambda op, i: _is_backward(op, 0, i), "IB", "after", "0B")


def _is(op, kind: Kind, stage: int, mb: int) -> bool:
    return type(op) is Action and op.kind is kind and op.stage == stage and op.microbatch == mb


def _is_backward(op, stage: int, mb: int) -> bool:
    return type(op) is Action and op.kind in (Kind.B, Kind.BW) and op.stage == stage and op.microbatch == mb


def _check_root(ops, rank: int, matches, kind: str, side: str, name: str) -> None:
    """On `rank`, each `kind`(i) must come `side` ("before"/"after") the action `matches(op, i)`."""
    where: dict[int, int] = {}
    anchor: dict[int, int] = {}
    for pos, op in enumerate(ops):
        if type(op) is VocabPass and op.kind == kind:
            where[op.microbatch] = pos
        elif type(op) is Action and matches(op, op.microbatch):
            anchor[op.microbatch] = pos
    for mb, pos in anchor.items():
        at = where.get(mb)
        if at is None:
            continue  # check_vocab names a missing pass
        if (at > pos) if side == "before" else (at < pos):
            raise ScheduleError(
                f"rank {rank}: {kind}{mb} runs {'after' if side == 'before' else 'before'} {name}{mb}, which "
                f"{'needs its result' if side == 'before' else 'it needs'}: move {kind}{mb} {side} {name}{mb}"
            )
