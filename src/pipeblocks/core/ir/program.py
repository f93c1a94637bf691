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

Each op type has an entry in the op table (`ops.py`), which every consumer dispatches on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .actions import Action
from .schedule import Schedule

__all__ = ["Comm", "DPOp", "DP_KINDS", "OptimizerStep", "Op", "Overlap", "Program", "Recompute", "expanded"]


class Comm(NamedTuple):
    """A point-to-point transfer seen from one rank.

    payload: "F" (activation, travels to stage+1) or "B" (input gradient, travels to stage-1).
    send: True on the producing rank, False on the consuming rank.
    stage: this rank's stage.  peer: the other rank.
    """

    payload: str
    send: bool
    stage: int
    microbatch: int
    seq_chunk: int | None
    peer: int

    @property
    def key(self) -> tuple[str, int, int, int]:
        """Identifies the tensor: (payload, producing stage, microbatch, chunk); equal on both ends."""
        if self.send:
            producer = self.stage
        else:
            producer = self.stage - 1 if self.payload == "F" else self.stage + 1
        return (self.payload, producer, self.microbatch, self.seq_chunk or 0)

    def __str__(self) -> str:
        text = f"{self.stage}{'SEND' if self.send else 'RECV'}_{self.payload}{self.microbatch}"
        return text if self.seq_chunk is None else f"{text}.{self.seq_chunk}"


DP_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")


class DPOp(NamedTuple):
    """A data-parallel op of one stage on its rank: `kind` is one of DP_KINDS; `unit` the
    unit of the stage's parameters it moves (None: the whole stage).

    It runs on the rank's communication stream; every pipeline replica runs the same
    Program, so the collective is symmetric across the replicas and never waits on a
    pipeline peer.
    """

    kind: str
    stage: int
    unit: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}" if self.unit is None else f"{self.stage}{self.kind}.{self.unit}"


class OptimizerStep(NamedTuple):
    """Stage `stage` applies optimizer step `step` (0, 1, ...) to its weights.

    Step k consumes the gradients of microbatches k*N .. k*N+N-1 (N microbatches per step)
    and makes the stage's weights version k+1; it runs on the compute stream and waits
    for nothing but the stage's own backwards.
    """

    stage: int
    step: int

    def __str__(self) -> str:
        return f"{self.stage}STEP{self.step}"



class Recompute(NamedTuple):
    """Re-run `stage`'s forward for `microbatch` (and `seq_chunk`) on the compute stream,
    rebuilding the activation its backward needs. Its forward then stores only the
    stage's input; the recomputation adds the rest back until B/W frees it."""

    stage: int
    microbatch: int
    seq_chunk: int | None = None

    @property
    def unit(self) -> tuple[int, int, int]:
        """The (stage, microbatch, sequence chunk) it rebuilds, as `Action.unit`."""
        return (self.stage, self.microbatch, self.seq_chunk or 0)

    def __str__(self) -> str:
        text = f"{self.stage}R{self.microbatch}"
        return text if self.seq_chunk is None else f"{text}.{self.seq_chunk}"


class Overlap(NamedTuple):
    """A forward and a fused backward (BW) of another unit on one rank, run as one op: the
    stage's `overlapped_forward_backward` hook may interleave them (DualPipe), else they run
    one after the other. Both inputs are awaited before it, both outputs sent after it."""

    forward: Action
    backward: Action

    @property
    def parts(self) -> tuple[Action, Action]:
        return (self.forward, self.backward)

    def __str__(self) -> str:
        return f"{self.forward}&{self.backward}"


Op = Action | Comm | DPOp | OptimizerStep | Recompute | Overlap


def expanded(ops: tuple[Op, ...]) -> list[Op]:
    """`ops` with every overlapped pair written as its two parts, forward first: for the
    checks and estimates that follow a rank's passes one by one."""
    out: list[Op] = []
    for op in ops:
        if type(op) is Overlap:
            out.extend(op)
        else:
            out.append(op)
    return out


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
        from .ops import format_op  # the table imports this module

        return "\n".join(f"{r}: " + " ".join(map(format_op, ops)) for r, ops in enumerate(self.ranks)) + "\n"

    @staticmethod
    def from_text(text: str, schedule: Schedule) -> Program:
        """Parse `to_text`'s form back, for `schedule` (which gives the placement)."""
        from .ops import parse_op

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
