"""The Program op types and their table.

Every op a Program may hold is defined here (but `Action` and `VocabPass`, which schedules
hold too: actions.py, vocab.py) and has one entry in the table: its Python type, its name, the stream it
occupies on its rank (compute, or communication beside it), and its text form (format and
parse). The text form, validation, the simulator and the runtime all dispatch on this
table; an op whose type is not in it, or that a consumer does not handle, is an
`UnknownOpError` naming the op and the consumer, never a silent skip.

Adding an op type (a DP gradient reduce, a parameter gather, a recomputation) is one entry
here plus the lowering pass that inserts it; each consumer then says whether it runs it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, NamedTuple

from .actions import Action
from .errors import ScheduleError
from .schedule import Schedule
from .vocab import VOCAB_RE, VocabPass

__all__ = ["Comm", "DPOp", "DP_KINDS", "OptimizerStep", "Op", "Overlap", "Recompute", "expanded", "spliced", "Stream", "OpType", "OP_TYPES", "ACTION", "P2P", "DP", "STEP", "RECOMPUTE", "VOCAB", "OVERLAP", "UnknownOpError", "op_type", "format_op", "parse_op", "require_known"]


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


def spliced(ops: tuple[Op, ...], insert_at: Mapping[int, Iterable[Op]]) -> tuple[Op, ...]:
    """`ops` with the ops `insert_at[i]` lists placed before ops[i] (at len(ops): after the last)."""
    if not insert_at:
        return ops
    out: list[Op] = []
    for i, op in enumerate(ops):
        out.extend(insert_at.get(i, ()))
        out.append(op)
    out.extend(insert_at.get(len(ops), ()))
    return tuple(out)


class Stream(str, Enum):
    """Where an op runs on its rank: in order on the compute stream, or on the
    communication stream beside it (waited on only by the op that needs its result)."""

    COMPUTE = "compute"
    COMMUNICATION = "communication"


class UnknownOpError(ScheduleError):
    """An op whose type is not in the table, or that a consumer does not run."""


@dataclass(frozen=True)
class OpType:
    """One kind of Program op.

    name: short name used in messages.  cls: the Python type of its ops.
    stream: where it runs.  pattern: its text form (a full match).
    parse: text -> op, given the schedule (for placement-derived fields such as a peer).
    """

    name: str
    cls: type
    stream: Stream
    pattern: re.Pattern[str]
    parse: Callable[[re.Match[str], Schedule], Op]
    format: Callable[[Op], str] = str


def _parse_action(match: re.Match[str], schedule: Schedule) -> Action:
    return Action.parse(match.group(0))


def _parse_comm(match: re.Match[str], schedule: Schedule) -> Comm:
    stage, direction, payload, mb, chunk = match.groups()
    s, send = int(stage), direction == "SEND"
    # F travels to stage+1, B to stage-1: the peer is the rank that holds the neighbour stage
    neighbour = s + 1 if (payload == "F") == send else s - 1
    if not 0 <= neighbour < schedule.num_stages:
        raise ScheduleError(
            f"op {match.group(0)!r}: stage {s} has no neighbour stage {neighbour} "
            f"(stages 0..{schedule.num_stages - 1})"
        )
    peer = schedule.placement.stage_to_rank[neighbour]
    return Comm(payload, send, s, int(mb), None if chunk is None else int(chunk), peer)


def _require_stage(match: re.Match[str], schedule: Schedule, stage: int | str) -> None:
    """ScheduleError unless `stage` (as the op's text writes it) is one of the schedule's."""
    if int(stage) >= schedule.num_stages:
        raise ScheduleError(f"op {match.group(0)!r}: stage {stage} does not exist (stages 0..{schedule.num_stages - 1})")


def _parse_dp(match: re.Match[str], schedule: Schedule) -> DPOp:
    stage, kind, unit = int(match.group(1)), match.group(2), match.group(3)
    _require_stage(match, schedule, stage)
    return DPOp(kind, stage, None if unit is None else int(unit))


ACTION = OpType(
    "action", Action, Stream.COMPUTE, re.compile(r"\d+(?:BW|F|B|W)\d+(?:\.\d+)?"), _parse_action
)
P2P = OpType(
    "p2p", Comm, Stream.COMMUNICATION, re.compile(r"(\d+)(SEND|RECV)_(F|B)(\d+)(?:\.(\d+))?"), _parse_comm
)

# Data-parallel collectives and parameter gather/free, named as torch names them; `.u`
# names one unit of the stage's parameters (`dp_units`).
DP = OpType(
    "dp", DPOp, Stream.COMMUNICATION, re.compile(r"(\d+)(UNSHARD|RESHARD|REDUCE_GRAD)(?:\.(\d+))?"), _parse_dp
)



def _parse_step(match: re.Match[str], schedule: Schedule) -> OptimizerStep:
    stage, step = (int(x) for x in match.groups())
    _require_stage(match, schedule, stage)
    return OptimizerStep(stage, step)


# A stage's optimizer step in an asynchronous program: compute stream, waits on its own rank only.
STEP = OpType("optimizer step", OptimizerStep, Stream.COMPUTE, re.compile(r"(\d+)STEP(\d+)"), _parse_step)


def _parse_recompute(match: re.Match[str], schedule: Schedule) -> Recompute:
    stage, mb, chunk = match.groups()
    _require_stage(match, schedule, stage)
    return Recompute(int(stage), int(mb), None if chunk is None else int(chunk))


# Re-run a forward before its backward: `2R5` reads like an action (stage, letter, microbatch).
RECOMPUTE = OpType(
    "recompute", Recompute, Stream.COMPUTE, re.compile(r"(\d+)R(\d+)(?:\.(\d+))?"), _parse_recompute
)

def _parse_overlap(match: re.Match[str], schedule: Schedule) -> Overlap:
    forward, backward = Action.parse(match.group(1)), Action.parse(match.group(2))
    for part in (forward, backward):
        _require_stage(match, schedule, part.stage)
    return Overlap(forward, backward)


# One microbatch's forward and another's fused backward as one op (DualPipe's F&B pair):
# `0F3&3BW1`; compute stream, waits for both inputs before it starts.
OVERLAP = OpType(
    "overlapped forward-backward", Overlap, Stream.COMPUTE, re.compile(r"(\d+F\d+)&(\d+BW\d+)"), _parse_overlap
)

def _parse_vocab(match: re.Match[str], schedule: Schedule) -> VocabPass:
    kind, mb = match.groups()
    if int(mb) >= schedule.m:
        raise ScheduleError(f"op {match.group(0)!r}: microbatch {mb} is out of range for m={schedule.m}")
    return VocabPass(kind, int(mb))


# A vocabulary pass run on every rank (vocabulary parallelism, `vocab.py`): `S5`, `T5`,
# `IF5`, `IB5`; compute stream, its collective on the communication stream.
VOCAB = OpType("vocabulary pass", VocabPass, Stream.COMPUTE, VOCAB_RE, _parse_vocab)

# One entry per op type, in the order parsing tries them.
OP_TYPES: tuple[OpType, ...] = (ACTION, P2P, DP, STEP, RECOMPUTE, VOCAB, OVERLAP)
_BY_CLASS: Mapping[type, OpType] = MappingProxyType({t.cls: t for t in OP_TYPES})


def op_type(op: object, consumer: str = "pipeblocks") -> OpType:
    """The table entry of `op`; UnknownOpError if its type has none."""
    entry = _BY_CLASS.get(type(op))
    if entry is None:
        raise UnknownOpError(
            f"{consumer}: op {op!r} of type {type(op).__name__} is not a Program op type "
            f"(known: {', '.join(t.name for t in OP_TYPES)}); add it to the op table in core/ir/ops.py"
        )
    return entry


def unsupported(op: object, consumer: str, supported: Iterable[OpType]) -> UnknownOpError:
    """The error for an op that `consumer` does not run (the caller raises it)."""
    entry = _BY_CLASS.get(type(op))
    kind = entry.name if entry else type(op).__name__
    return UnknownOpError(
        f"{consumer} cannot run op {op} (type {kind}); it runs {', '.join(t.name for t in supported)} ops: "
        "lower without the pass that added it, or teach this consumer the op type"
    )


def require_known(ops: Iterable[object], consumer: str, supported: Iterable[OpType]) -> None:
    """Raise UnknownOpError for the first op that `consumer` (running `supported`) cannot run."""
    classes = {t.cls for t in supported}
    for op in ops:
        if type(op) not in classes:
            op_type(op, consumer)  # an unknown type says so first
            raise unsupported(op, consumer, supported)


def format_op(op: Op) -> str:
    return op_type(op).format(op)


def parse_op(text: str, schedule: Schedule) -> Op:
    """Parse one op's text form (`2F5`, `2SEND_F5`, ...); an error naming the forms otherwise."""
    token = text.strip()
    for entry in OP_TYPES:
        match = entry.pattern.fullmatch(token)
        if match is not None:
            return entry.parse(match, schedule)
    raise UnknownOpError(
        f"cannot parse op {text!r}: expected an action (2F5, 0BW2, 0B3.1), a transfer (2SEND_F5, 3RECV_B5.1), "
        "a data-parallel op (2UNSHARD, 2RESHARD, 2REDUCE_GRAD, 2UNSHARD.1), an optimizer step (3STEP0), a recomputation (2R5, 0R3.1) "
        "or an overlapped forward-backward pair (0F3&3BW1)"
    )
