"""torch.distributed.pipelining's compute-only schedule format, both ways.

    from pipeblocks.interop import to_torch_csv, from_torch_csv
    text = to_torch_csv(get("zb-v")(p=4, m=8))        # one CSV row per rank
    schedule = from_torch_csv(text, placement="v")    # back to a pipeblocks Schedule

Torch then loads the file with
`_PipelineScheduleRuntime(stages, n_microbatches, loss_fn=...)._load_csv(path, format="compute_only")`
(private API in torch 2.13), which validates it and adds the sends and receives.

Names. Our B (input gradient) is torch's I; our fused BW is torch's B; F and W are the same:

    pipeblocks  2F5  0B3  1W3  0BW2
    torch       2F5  0I3  1W3  0B2

Stages. Both number global stages in model order and place them the same way: loop puts
stage s on rank s mod p, V puts stages i and 2p-1-i on rank i (torch's "v" mapping), so
stage indices carry over unchanged and torch infers the placement from the rows. Torch
has no sequence chunks: a schedule with seq_chunks > 1 cannot be exported. On import,
empty cells (idle slots) are dropped.

Overlapped pairs (DualPipeV) are one cell each way: our `0F3&3BW1` is torch's
`(0F3;3B1)OVERLAP_F_B`; imported, a pair of a forward and a full backward keeps its
overlap (`Schedule.overlapped`), any other composite cell becomes its actions in order.
"""
from __future__ import annotations

import csv
import io
import re
from typing import Sequence

from ..core.ir.actions import Action, Kind
from ..core.ir.errors import ScheduleError
from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule, stage_owners

__all__ = ["to_torch_rows", "to_torch_csv", "from_torch_rows", "from_torch_csv"]

_TO_TORCH = {Kind.F: "F", Kind.B: "I", Kind.W: "W", Kind.BW: "B"}
_FROM_TORCH = {"F": Kind.F, "I": Kind.B, "W": Kind.W, "B": Kind.BW}
_CELL = re.compile(r"^(\d+)(F|I|W|B)(\d+)$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")


def to_torch_rows(schedule: Schedule) -> list[list[str]]:
    """Per rank, the actions in torch's text form."""
    if schedule.seq_chunks != 1:
        raise ScheduleError(
            f"schedule {schedule.name!r} splits sequences into {schedule.seq_chunks} chunks; "
            "torch.distributed.pipelining has no sequence chunks: export a schedule with seq_chunks=1"
        )
    if schedule.chains != 1:
        raise ScheduleError(
            f"schedule {schedule.name!r} runs {schedule.chains} directions (each stage held twice); "
            "torch.distributed.pipelining has no such schedule: export dualpipev (torch's ScheduleDualPipeV) instead"
        )
    rows = []
    for actions in schedule.ranks:
        cells = [f"{a.stage}{_TO_TORCH[a.kind]}{a.microbatch}" for a in actions]
        if schedule.overlapped:
            merged: list[str] = []
            pending = False
            for action, cell in zip(actions, cells):
                if pending:
                    merged[-1] = f"({merged[-1]};{cell})OVERLAP_F_B"
                else:
                    merged.append(cell)
                pending = action in schedule.overlapped
            cells = merged
        rows.append(cells)
    return rows


def to_torch_csv(schedule: Schedule) -> str:
    """The compute-only CSV torch's `_load_csv(path, format="compute_only")` reads."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(to_torch_rows(schedule))
    return out.getvalue()


def from_torch_rows(
    rows: Sequence[Sequence[str]], *, p: int | None = None, m: int | None = None,
    placement: Placement | str | None = None, name: str = "torch",
) -> Schedule:
    """A Schedule from per-rank torch action strings.

    p: ranks (default: the number of rows).  m: microbatches (default: largest index + 1).
    placement: "loop", "v", a Placement, or None to infer it from where the stages appear.
    The result is not validated; call `pipeblocks.core.lowering.validate` on it.
    """
    ranks: list[tuple[Action, ...]] = []
    overlapped: set[Action] = set()
    for rank, row in enumerate(rows):
        actions: list[Action] = []
        for pos, cell in enumerate(row):
            parts = _parse_cell(cell, rank, pos)
            if len(parts) == 2 and parts[0].kind is Kind.F and parts[1].kind is Kind.BW:
                overlapped.add(parts[0])
            actions.extend(parts)
        ranks.append(tuple(actions))
    if not ranks or not any(ranks):
        raise ScheduleError("torch schedule has no actions: expected one CSV row per rank, e.g. '0F0,0I0,0W0'")
    p = len(ranks) if p is None else p
    if len(ranks) != p:
        raise ScheduleError(f"torch schedule has {len(ranks)} rows but p={p}: give one row per rank")
    used = max(a.microbatch for acts in ranks for a in acts) + 1
    m = used if m is None else m
    num_stages = max(a.stage for acts in ranks for a in acts) + 1
    return Schedule(name, p, m, _placement(placement, ranks, p, num_stages), tuple(ranks),
                    overlapped=frozenset(overlapped))


def from_torch_csv(
    text: str, *, p: int | None = None, m: int | None = None,
    placement: Placement | str | None = None, name: str = "torch",
) -> Schedule:
    """A Schedule from torch's compute-only CSV text (see `from_torch_rows`)."""
    rows = [row for row in csv.reader(io.StringIO(text)) if any(cell.strip() for cell in row)]
    return from_torch_rows(rows, p=p, m=m, placement=placement, name=name)


def _parse_cell(cell: str, rank: int, pos: int) -> list[Action]:
    text = cell.strip()
    if not text:
        return []  # an idle slot
    overlap = _OVERLAP.match(text)
    if overlap:
        return [a for part in overlap.group(1).split(";") for a in _parse_cell(part, rank, pos)]
    match = _CELL.match(text)
    if match is None:
        raise ScheduleError(
            f"rank {rank}, cell {pos}: {text!r} is not a compute action; the compute-only format holds "
            "<stage><F|I|W|B><microbatch> cells such as 2F5 or 0I3 (no SEND/RECV, UNSHARD, RESHARD, REDUCE_GRAD)"
        )
    stage, kind, mb = match.groups()
    return [Action(int(stage), _FROM_TORCH[kind], int(mb))]


def _placement(
    given: Placement | str | None, ranks: list[tuple[Action, ...]], p: int, num_stages: int
) -> Placement:
    if isinstance(given, Placement):
        return given
    if given == "loop":
        if num_stages % p:
            raise ScheduleError(f"loop placement needs a multiple of p={p} stages, the schedule uses {num_stages}")
        return Placement.loop(p, num_stages // p)
    if given == "v":
        return Placement.v_shape(p)
    if given is not None:
        raise ScheduleError(f"placement must be 'loop', 'v', a Placement or None, got {given!r}")
    mapping = stage_owners(ranks, num_stages=num_stages)
    for shape in (Placement.loop(p, max(1, num_stages // p)), Placement.v_shape(p)):
        if shape.stage_to_rank == mapping:
            return shape
    return Placement(mapping)
