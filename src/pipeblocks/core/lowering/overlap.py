"""Overlapped forward-backward pairs: their check in a Schedule and the lowering pass that
makes each one op.

A schedule marks a forward `overlapped` when it runs together with the fused backward
right after it on its rank (DualPipe's F&B chunk pair, DeepSeek-V3 section 3.2.1)::

    0: ... 0F3&3BW1 3F2&0BW0 ...

Every other pass of lowering (sends and receives, data-parallel ops, recomputation) sees
the two as plain actions. `fuse_overlaps` runs last and makes each pair one `Overlap` op:
the receives of both parts (and anything else lowering put between them) move before it,
the forward's sends after it. So both inputs are awaited before the pair starts, as
DeepSeek's and torchtitan's runtimes do::

    0RECV_F3 3RECV_B1 0F3&3BW1 0SEND_F3 3SEND_B1
"""
from __future__ import annotations

from ..ir.actions import Action, Kind
from ..ir.errors import ScheduleError
from ..ir.ops import Comm, Op, Overlap
from ..ir.program import Program
from ..ir.schedule import Schedule

__all__ = ["check_overlaps", "fuse_overlaps"]


def check_overlaps(schedule: Schedule) -> None:
    """Raise ScheduleError unless every overlapped forward is followed on its rank by a fused
    backward (BW) of another unit, with no sequence chunks."""
    marked = schedule.overlapped
    if not marked:
        return
    if schedule.seq_chunks > 1:
        raise ScheduleError(
            f"schedule {schedule.name!r}: overlapped pairs with seq_chunks={schedule.seq_chunks}: an overlapped "
            "forward-backward pair runs whole microbatches; drop the sequence chunks or the pairs"
        )
    found = 0
    for rank, actions in enumerate(schedule.ranks):
        for pos, action in enumerate(actions):
            if action not in marked:
                continue
            found += 1
            after = actions[pos + 1] if pos + 1 < len(actions) else None
            if action.kind is not Kind.F or after is None or after.kind is not Kind.BW or after.unit == action.unit:
                raise ScheduleError(
                    f"rank {rank}, action {pos} ({action}): an overlapped pair is a forward and the fused backward "
                    f"(BW) of another unit right after it, e.g. 0F3&3BW1; got {action}&{after}"
                )
    if found != len(marked):
        missing = sorted(marked - {a for actions in schedule.ranks for a in actions})
        raise ScheduleError(
            f"schedule {schedule.name!r}: overlapped forward(s) {', '.join(map(str, missing))} are in no rank's list"
        )


def fuse_overlaps(program: Program) -> Program:
    """Make every overlapped pair of the schedule one `Overlap` op (the last lowering pass)."""
    marked = program.schedule.overlapped
    if not marked:
        return program
    ranks: list[tuple[Op, ...]] = []
    for ops in program.ranks:
        out: list[Op] = []
        pos = 0
        while pos < len(ops):
            op = ops[pos]
            if type(op) is not Action or op not in marked:
                out.append(op)
                pos += 1
                continue
            end = next(i for i in range(pos + 1, len(ops)) if type(ops[i]) is Action)
            between = ops[pos + 1:end]
            sends = [o for o in between if type(o) is Comm and o.send and o.payload == "F" and o.stage == op.stage
                     and o.microbatch == op.microbatch]
            out.extend(o for o in between if not (type(o) is Comm and o in sends))
            out.append(Overlap(op, ops[end]))
            out.extend(sends)
            pos = end + 1
        ranks.append(tuple(out))
    return Program(program.schedule, tuple(ranks))
