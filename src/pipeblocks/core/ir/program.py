"""The lowered Program: per rank, compute actions interleaved with communication ops.

Text form of a communication op follows torch.distributed.pipelining: the stage is the
stage on this rank, the payload travels to or from its neighbour stage::

    2SEND_F5   stage 2 sends its output activation of microbatch 5 to stage 3
    3RECV_F5   stage 3 receives its input activation of microbatch 5 from stage 2
    3SEND_B5   stage 3 sends the gradient of its input, microbatch 5, to stage 2
    2RECV_B5   stage 2 receives the gradient of its output, microbatch 5, from stage 3

Data-parallel ops (`DPOp`) name a stage, as torch does, and the unit of the stage's
parameters they move when the stage has several (`dp_units`: one per block at block grain)::

    2UNSHARD      gather stage 2's sharded parameters (ZeRO-3 / FSDP all-gather)
    2RESHARD      free the gathered parameters again
    2REDUCE_GRAD  reduce stage 2's accumulated gradients over the data-parallel replicas
    2UNSHARD.1    gather unit 1 of stage 2 only (its second block at block grain)
    2REDUCE_GRAD.0  reduce unit 0's gradients

An optimizer step of one stage (asynchronous programs, which run several steps without a
flush) reads `<stage>STEP<step>`::

    3STEP0        stage 3 applies its optimizer step 0 (its first), after the backwards
                  of that step's microbatches

Recomputation (`Recompute`, added by `recompute.add_recompute`) re-runs one forward just
before its backward; the forward marked for it keeps only the chunk's input::

    2R5           re-run stage 2's forward for microbatch 5 (2R5.1: sequence chunk 1)

An overlapped forward-backward pair (`Overlap`, made by `overlap.fuse_overlaps` from a
schedule's `overlapped` forwards) runs one microbatch's forward and another's fused
backward on one rank as one op, both inputs received before it and both outputs sent
after it (DualPipe's chunk pair; torch writes it `(0F3;3B1)OVERLAP_F_B`)::

    0F3&3BW1      stage 0's forward of microbatch 3 overlapped with stage 3's backward of 1

Each op type is defined with its entry in the op table (`ops.py`), which every consumer dispatches on.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ops import Op, format_op, parse_op  # the op types a Program holds live with their table
from .schedule import Schedule

__all__ = ["Program"]


@dataclass(frozen=True)
class Program:
    """A schedule lowered for execution: `ranks[r]` is rank r's ops in order."""

    schedule: Schedule
    ranks: tuple[tuple[Op, ...], ...]

    @property
    def p(self) -> int:
        return self.schedule.p

    def to_text(self) -> str:
        """One line per rank, `r: op op ...`, each op in its table's text form."""
        return "\n".join(f"{r}: " + " ".join(map(format_op, ops)) for r, ops in enumerate(self.ranks)) + "\n"

    @staticmethod
    def from_text(text: str, schedule: Schedule) -> Program:
        """Parse `to_text`'s form back, for `schedule` (which gives the placement)."""
        ranks: list[tuple[Op, ...]] = []
        for line in text.splitlines():
            if not line.strip():
                continue
            head, sep, body = line.partition(":")
            if not sep or head.strip() != str(len(ranks)):
                raise ValueError(f"program line {line!r}: expected '{len(ranks)}: op op ...' (ranks in order)")
            ranks.append(tuple(parse_op(token, schedule) for token in body.split()))
        if len(ranks) != schedule.p:
            raise ValueError(f"program has {len(ranks)} rank lines but the schedule has p={schedule.p}")
        return Program(schedule, tuple(ranks))
