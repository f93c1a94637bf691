"""Lowering a Schedule into a Program, and the deadlock check.

Lowering is an ordered list of passes, each `Program -> Program`, applied to the schedule's
compute actions. The first, `add_p2p`, puts a receive just before the action that
consumes a tensor from another rank and a send just after the action that produces one.
Neighbouring stages on one rank (the turn of a V) hand over locally, with no op. Later
passes (DP gradient reduce, parameter gather and free: `passes_dp.dp_passes`;
recomputation: `recompute.add_recompute`) follow it. Which passes a run needs, in which
order, is decided in one place, `lowering.lower_for`, which every consumer calls.

The deadlock check runs the Program under the runtime's semantics: sends never block
(they are posted asynchronously), receives block until the matching send has run, and an
optimizer step waits only for its own stage's backwards, which precede it on its rank.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..ir.actions import Action, Kind
from ..ir.errors import DeadlockError
from ..ir.ops import ACTION, Comm, DP, DPOp, OVERLAP, Op, OptimizerStep, Overlap, P2P, RECOMPUTE, Recompute, STEP, unsupported
from ..ir.program import Program
from ..ir.schedule import Schedule
from ..ir.vocab import VocabPass
from .vocab_links import barriers_of, key_name, links

__all__ = ["Pass", "PASSES", "lower", "add_p2p", "check_deadlock"]

Pass = Callable[[Program], Program]


def add_p2p(program: Program) -> Program:
    """Insert point-to-point sends and receives around the compute actions that cross ranks."""
    schedule = program.schedule
    rank_of = schedule.placement.stage_to_rank
    # stages that start / end a chain take the input / compute the loss: no transfer there
    length = schedule.num_stages // schedule.chains
    starts = frozenset(range(0, schedule.num_stages, length))
    ends = frozenset(s + length - 1 for s in starts)
    programs: list[tuple[Op, ...]] = []
    new = tuple.__new__  # Comm(...) without the Python-level NamedTuple __new__: one per transfer
    action_type = Action

    for rank, actions in enumerate(program.ranks):
        ops: list[Op] = []
        for a in actions:
            if type(a) is not action_type:
                ops.append(a)  # an op of an earlier pass: kept in place
                continue
            s, mb, chunk = a.stage, a.microbatch, a.seq_chunk
            kind = a.kind
            if kind is Kind.F:
                if s not in starts and rank_of[s - 1] != rank:
                    ops.append(new(Comm, ("F", False, s, mb, chunk, rank_of[s - 1])))
                ops.append(a)
                if s not in ends and rank_of[s + 1] != rank:
                    ops.append(new(Comm, ("F", True, s, mb, chunk, rank_of[s + 1])))
            elif kind is Kind.W:
                ops.append(a)
            else:
                if s not in ends and rank_of[s + 1] != rank:
                    ops.append(new(Comm, ("B", False, s, mb, chunk, rank_of[s + 1])))
                ops.append(a)
                if s not in starts and rank_of[s - 1] != rank:
                    ops.append(new(Comm, ("B", True, s, mb, chunk, rank_of[s - 1])))
        programs.append(tuple(ops))
    return Program(schedule, tuple(programs))


# The lowering pipeline, in order. Each pass takes and returns a Program.
PASSES: tuple[Pass, ...] = (add_p2p,)


def lower(schedule: Schedule, passes: Sequence[Pass] = PASSES) -> Program:
    """The schedule's compute actions, run through `passes` in order. Assumes
    `check_structure` passed."""
    program = Program(schedule, tuple(tuple(actions) for actions in schedule.ranks))
    for lowering_pass in passes:
        program = lowering_pass(program)
    return program


def check_deadlock(program: Program) -> None:
    """Raise DeadlockError naming every blocked rank and what it waits on.

    One walk serves every Program: an op may wait for keys that other ops post. A receive
    waits for its send's key; with vocabulary passes their collectives and broadcasts are
    keys too (`vocab_links.links`: what each op position receives before it and sends after
    it). Sends and posted keys never block."""
    ranks = program.ranks
    vocab = any(type(op) is VocabPass for ops in ranks for op in ops)
    extra = links(program, barriers_of(program)) if vocab else [{} for _ in ranks]
    cursor = [0] * len(ranks)
    sent: set = set()
    waiting: dict = {}
    blocked_on: dict[int, object] = {}
    ready = list(range(len(ranks)))
    while ready:
        rank = ready.pop()
        ops, table = ranks[rank], extra[rank]
        pos = cursor[rank]
        while pos < len(ops):
            op = ops[pos]
            kind = type(op)
            if (kind is not Comm and kind is not Action and kind is not DPOp and kind is not OptimizerStep
                    and kind is not Recompute and kind is not Overlap and not (vocab and kind is VocabPass)):
                # DP ops never wait on a pipeline peer: every replica runs this same Program;
                # an optimizer step and a recomputation wait on their own rank only; an
                # overlapped pair's receives are all before it
                raise unsupported(op, "the deadlock check", (ACTION, P2P, DP, STEP, RECOMPUTE, OVERLAP))
            link = table.get(pos)
            need = ([op.key] if kind is Comm and not op.send else []) + (link[0] if link else [])
            missing = next((key for key in need if key not in sent), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                blocked_on[rank] = missing
                break
            posted = ([op.key] if kind is Comm and op.send else []) + (link[1] if link else [])
            for key in posted:
                sent.add(key)
                ready.extend(waiting.pop(key, ()))
            pos += 1
        cursor[rank] = pos
    blocked = [r for r in range(len(ranks)) if cursor[r] < len(ranks[r])]
    if blocked:
        lines = [_blocked_line(program, cursor, r, blocked_on.get(r)) for r in blocked]
        raise DeadlockError(
            f"schedule {program.schedule.name!r} (p={program.p}, m={program.schedule.m})"
            + (" with vocabulary passes" if vocab else "") + " deadlocks:\n  " + "\n  ".join(lines)
            + ("\nplace each vocabulary pass where its input is ready on every rank (vocab_place.add_vocab does)"
               if vocab else
               "\nreorder the actions so that each rank produces what another rank waits for before it waits itself")
        )


def _blocked_line(program: Program, cursor: list[int], rank: int, key) -> str:
    ranks = program.ranks
    op = ranks[rank][cursor[rank]]
    if type(op) is Comm and not op.send and key == op.key:
        peer = op.peer
        consumer = next((o for o in ranks[rank][cursor[rank]:] if isinstance(o, (Action, Overlap))), None)
        where = ranks[peer][cursor[peer]] if cursor[peer] < len(ranks[peer]) else "its end"
        return (f"rank {rank} blocks at {op} (before {consumer}), waiting for rank {peer}, "
                f"which is itself blocked at {where}")
    return f"rank {rank} blocks at {op}, waiting for {key_name(key)}"
