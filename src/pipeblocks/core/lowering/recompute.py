"""Recomputation as a lowering pass: `add_recompute(pairs)` and `check_recompute`.

A pair (stage, microbatch) marked for recomputation keeps only the stage's input after its
forward; a `Recompute` op re-runs that forward on the stage's rank before the pair's first
backward pass (B or fused BW). By default it runs just before that backward, placed before
the receives the backward waits on, so the recomputation runs while the rank would
otherwise wait for the incoming gradient. With sequence chunks every chunk of the
microbatch is recomputed. 1F1B, p=2, m=2, every pair recomputed::

    0: 0F0 0SEND_F0 0F1 0SEND_F1 0R0 0RECV_B0 0BW0 0R1 0RECV_B1 0BW1
    1: 1RECV_F0 1F0 1R0 1BW0 1SEND_B0 1RECV_F1 1F1 1R1 1BW1 1SEND_B1

`at` moves a unit's recomputation earlier, into idle time the simulator found
(`resolve.recompute_place`): before another compute action of its rank (and before that
action's receives), anywhere after the unit's own forward. Rank 0 above with 0R1 run in
the wait for 0BW0's gradient, `at={(0, 1, 0): 0BW0}`::

    0: 0F0 0SEND_F0 0F1 0SEND_F1 0R1 0R0 0RECV_B0 0BW0 0RECV_B1 0BW1

`check_recompute` proves the placement: each Recompute on the rank that holds its stage,
at most once per (stage, microbatch, chunk), after its forward and before its first
backward pass.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..ir.actions import Action, Kind
from ..ir.errors import ScheduleError
from ..ir.ops import Comm, Op, Recompute, expanded
from ..ir.program import Program
from ..ir.schedule import Schedule

__all__ = ["add_recompute", "all_pairs", "check_recompute", "recompute_pairs", "recompute_units"]

Pair = tuple[int, int]


def all_pairs(schedule: Schedule) -> frozenset[Pair]:
    """Every (stage, microbatch) of the schedule: full recomputation."""
    return frozenset((s, mb) for s in range(schedule.num_stages) for mb in range(schedule.m))


def recompute_pairs(schedule: Schedule, pairs: Iterable[Pair] | None = None) -> frozenset[Pair]:
    """The (stage, microbatch) pairs a run recomputes: `pairs` when any are given, else the
    schedule's own (every pair when its options say recompute="all", as `1f1b-r`; none
    otherwise). Raises ScheduleError for a pair outside the schedule."""
    given = _normalise(pairs or (), schedule)
    if given:
        return given
    if schedule.options and schedule.option("recompute") == "all":
        return all_pairs(schedule)
    return frozenset()


def _normalise(pairs: Iterable[Pair], schedule: Schedule) -> frozenset[Pair]:
    out = set()
    for pair in pairs:
        try:
            stage, mb = (int(x) for x in pair)
        except (TypeError, ValueError):
            raise ScheduleError(f"recompute pair {pair!r}: expected (stage, microbatch)") from None
        if not (0 <= stage < schedule.num_stages and 0 <= mb < schedule.m):
            raise ScheduleError(
                f"recompute pair ({stage}, {mb}) is outside the schedule: stages 0..{schedule.num_stages - 1}, "
                f"microbatches 0..{schedule.m - 1}"
            )
        out.add((stage, mb))
    return frozenset(out)


Unit = tuple[int, int, int]


def add_recompute(pairs: Iterable[Pair], at: Mapping[Unit, Action] | None = None):
    """The pass inserting a `Recompute` for every unit of `pairs`: before the compute action
    `at` names for it (with its receives: the recomputation fills the wait for them), else
    before its first backward. Units anchored to one action run in `at`'s order."""
    pairs = tuple(pairs)
    at = dict(at or {})

    def add_recompute_pass(program: Program) -> Program:
        chosen = _normalise(pairs, program.schedule)
        if not chosen:
            return program
        anchored: dict[Action, list[Unit]] = {}
        for unit, anchor in at.items():
            if (unit[0], unit[1]) in chosen:
                anchored.setdefault(anchor, []).append(tuple(unit))
        moved = {unit for units in anchored.values() for unit in units}
        chunked = program.schedule.seq_chunks > 1
        ranks = []
        for ops in program.ranks:
            out: list[Op] = []
            done: set[Unit] = set()
            for op in ops:
                if type(op) is Action:
                    due = [u for u in anchored.get(op, ()) if u not in done]
                    if op.kind is not Kind.F and op.kind is not Kind.W:
                        unit = op.unit
                        if (unit[0], unit[1]) in chosen and unit not in done and unit not in moved:
                            due.append(unit)
                    if due:
                        # before the receives of this action: recompute while what it waits for travels
                        where = len(out)
                        while where and type(out[where - 1]) is Comm and not out[where - 1].send:
                            where -= 1
                        out[where:where] = [Recompute(u[0], u[1], u[2] if chunked else None) for u in due]
                        done.update(due)
                out.append(op)
            ranks.append(tuple(out))
        return Program(program.schedule, tuple(ranks))

    add_recompute_pass.__name__ = "add_recompute"
    return add_recompute_pass


def recompute_units(ops: Iterable[Op]) -> frozenset[tuple[int, int, int]]:
    """The (stage, microbatch, chunk) units a rank's ops recompute."""
    return frozenset(op.unit for op in ops if type(op) is Recompute)


def check_recompute(program: Program) -> None:
    """Raise ScheduleError for a Recompute on the wrong rank, repeated, before its forward
    or after its first backward pass."""
    rank_of = program.schedule.placement.stage_to_rank
    for rank, ops in enumerate(program.ranks):
        forwarded: set[tuple[int, int, int]] = set()
        backwarded: set[tuple[int, int, int]] = set()
        seen: set[tuple[int, int, int]] = set()
        for op in expanded(ops):
            if type(op) is Action:
                (forwarded if op.kind is Kind.F else backwarded).add(op.unit)
            elif type(op) is Recompute:
                unit = op.unit
                where = f"rank {rank}, op {op}"
                if unit[0] >= len(rank_of) or rank_of[unit[0]] != rank:
                    raise ScheduleError(f"{where}: stage {unit[0]} is not on this rank; recompute on the stage's rank")
                if unit in seen:
                    raise ScheduleError(f"{where}: recomputed twice; keep one recomputation per forward")
                if unit not in forwarded:
                    raise ScheduleError(f"{where}: comes before the forward it re-runs; place it after {op.stage}F{op.microbatch}")
                if unit in backwarded:
                    raise ScheduleError(
                        f"{where}: comes after the backward that needs it; place it before {op.stage}B{op.microbatch} / BW"
                    )
                seen.add(unit)
