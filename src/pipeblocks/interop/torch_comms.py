"""torch.distributed.pipelining's lowered ("compute_comms") CSV: a whole Program, both ways.

    from pipeblocks.interop import program_to_torch_csv, program_from_torch_csv
    text = program_to_torch_csv(program)            # compute, SEND/RECV and DP ops per rank
    program = program_from_torch_csv(text)          # back to a Program (placement inferred)

Torch loads it with `_load_csv(path, format="compute_comms")`, which takes the order as
given. Every op has torch's name: compute as in the compute-only CSV (our B is torch's I,
our BW torch's B), transfers and DP ops as they are in our text form (`2SEND_F5`,
`3RECV_B1`, `1UNSHARD`, `1RESHARD`, `0REDUCE_GRAD`): torch and pipeblocks both name a
transfer by the stage on the rank that runs it. Sequence chunks have no torch form, and
neither has a recomputation (`RECOMPUTE`) nor an optimizer step: a Program holding one is
refused with the option to drop, not written without it (torch recomputes inside the
module, by activation checkpointing, which the CSV does not carry). torch's DP actions are
per stage, so a Program whose DP ops name a unit (`--dp-unit block`, `2UNSHARD.1`) is
refused too, with `--dp-unit chunk` as the fix.
"""
from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence

from ..core.ir.actions import Action
from ..core.ir.errors import ScheduleError
from ..core.ir.ops import Comm, DPOp, OptimizerStep, Overlap, Recompute, format_op, parse_op
from ..core.ir.placement import Placement
from ..core.ir.program import Program
from ..core.ir.schedule import Schedule
from .torch_pipelining import _TO_TORCH, from_torch_rows, to_torch_rows

__all__ = ["program_from_torch_csv", "program_from_torch_rows", "program_to_torch_csv", "program_to_torch_rows"]

_COMM = re.compile(r"^\d+(?:SEND|RECV)_[FB]\d+$|^\d+(?:UNSHARD|RESHARD|REDUCE_GRAD)$")


def program_to_torch_rows(program: Program) -> list[list[str]]:
    """Per rank, every op of the Program in torch's text form."""
    to_torch_rows(program.schedule)  # raises for what torch cannot run (sequence chunks, two directions)
    rows = []
    for rank, ops in enumerate(program.ranks):
        step = next((op for op in ops if type(op) is OptimizerStep), None)
        if step is not None:
            raise ScheduleError(
                f"rank {rank} holds optimizer step {step}: torch.distributed.pipelining has no optimizer-step "
                "action, so an asynchronous program cannot be exported (export its synchronous schedule instead)"
            )
        recompute = next((op for op in ops if type(op) is Recompute), None)
        if recompute is not None:
            raise ScheduleError(
                f"rank {rank} holds recomputation {format_op(recompute)}: torch.distributed.pipelining has no "
                "recompute action, so a recomputing program cannot be exported as torch's CSV: drop the "
                "recomputation (--recompute none, or the schedule without -r, e.g. 1f1b for 1f1b-r) and checkpoint "
                "the modules' activations in torch instead"
            )
        unit = next((op for op in ops if type(op) is DPOp and op.unit is not None), None)
        if unit is not None:
            raise ScheduleError(
                f"rank {rank} holds {format_op(unit)}, a DP op of one unit of stage {unit.stage}: "
                "torch.distributed.pipelining's UNSHARD, RESHARD and REDUCE_GRAD act on a whole stage, so a program at "
                "block grain cannot be exported as torch's CSV: lower it with --dp-unit chunk"
            )
        rows.append([_torch_cell(op) for op in ops])
    return rows


def _torch_cell(op) -> str:
    """One op in torch's lowered text form: compute actions renamed (our B is torch's I, our BW
    its B), an overlapped pair as `(F;B)OVERLAP_F_B`, every other op as the op table writes it."""
    if type(op) is Action:
        return f"{op.stage}{_TO_TORCH[op.kind]}{op.microbatch}"
    if type(op) is Overlap:
        return f"({_torch_cell(op.forward)};{_torch_cell(op.backward)})OVERLAP_F_B"
    return format_op(op)


def program_to_torch_csv(program: Program) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(program_to_torch_rows(program))
    return out.getvalue()


def program_from_torch_rows(
    rows: Sequence[Sequence[str]], *, m: int | None = None, placement: Placement | str | None = None,
    name: str = "torch",
) -> Program:
    """A Program from per-rank cells of torch's lowered format (empty cells are skipped).
    The compute cells make the Schedule (`from_torch_rows`), the others keep their place."""
    cells = [[c.strip() for c in row if c.strip()] for row in rows]
    schedule: Schedule = from_torch_rows(
        [[c for c in row if not _COMM.match(c)] for row in cells], m=m, placement=placement, name=name,
    )
    ranks = []
    for rank, row in enumerate(cells):
        actions = iter(schedule.ranks[rank])
        ops = []
        for pos, cell in enumerate(row):
            if not _COMM.match(cell):
                action = next(actions)
                if action in schedule.overlapped:  # an (F;B)OVERLAP_F_B cell: one op
                    ops.append(Overlap(action, next(actions)))
                else:
                    ops.append(action)
                continue
            op = parse_op(cell, schedule)
            if isinstance(op, Comm) and schedule.placement.stage_to_rank[op.stage] != rank or (
                isinstance(op, DPOp) and schedule.placement.stage_to_rank[op.stage] != rank
            ):
                raise ScheduleError(f"rank {rank}, cell {pos}: {cell!r} names stage {op.stage}, which is not on rank {rank}")
            ops.append(op)
        ranks.append(tuple(ops))
    return Program(schedule, tuple(ranks))


def program_from_torch_csv(
    text: str, *, m: int | None = None, placement: Placement | str | None = None, name: str = "torch",
) -> Program:
    rows = [row for row in csv.reader(io.StringIO(text)) if any(cell.strip() for cell in row)]
    return program_from_torch_rows(rows, m=m, placement=placement, name=name)
