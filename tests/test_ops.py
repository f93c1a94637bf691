"""The op table and the lowering passes: text form round trip, unknown ops are errors."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from pipeblocks.core import Program, lower, simulate_program
from pipeblocks.core.lowering.lower import PASSES, add_p2p, check_deadlock
from pipeblocks.core.ir.ops import ACTION, OP_TYPES, P2P, Stream, UnknownOpError, op_type, parse_op, require_known
from pipeblocks.schedules import get


@dataclass(frozen=True)
class Mystery:
    """An op type no table entry knows."""

    stage: int

    def __str__(self) -> str:
        return f"{self.stage}MYSTERY"


def _with_foreign_op(program: Program) -> Program:
    ranks = list(program.ranks)
    ranks[0] = (*ranks[0][:2], Mystery(0), *ranks[0][2:])
    return Program(program.schedule, tuple(ranks))


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "interleaved-1f1b", "seq1f1b"])
def test_program_text_round_trips_through_the_table(name):
    schedule = get(name)(p=3, m=6)
    program = lower(schedule)
    assert Program.from_text(program.to_text(), schedule) == program


def test_table_declares_streams():
    assert op_type(get("1f1b")(p=2, m=2).ranks[0][0]) is ACTION
    assert ACTION.stream is Stream.COMPUTE and P2P.stream is Stream.COMMUNICATION
    assert len({t.cls for t in OP_TYPES}) == len(OP_TYPES)


def test_parse_op_names_the_forms_on_bad_text():
    schedule = get("1f1b")(p=2, m=2)
    with pytest.raises(UnknownOpError, match="cannot parse op '0GATHER1'"):
        parse_op("0GATHER1", schedule)
    with pytest.raises(ValueError, match="no neighbour stage 2"):
        parse_op("1SEND_F0", schedule)  # the last stage sends no activation


def test_lower_is_an_ordered_list_of_passes():
    schedule = get("1f1b")(p=3, m=4)
    assert PASSES[0] is add_p2p
    seen = []

    def tag(program: Program) -> Program:
        seen.append(sum(map(len, program.ranks)))
        return program

    program = lower(schedule, passes=(add_p2p, tag))
    assert program == lower(schedule)
    assert seen == [sum(map(len, program.ranks))]
    bare = lower(schedule, passes=())
    assert bare.ranks == schedule.ranks


def test_simulator_rejects_an_unknown_op():
    program = _with_foreign_op(lower(get("1f1b")(p=2, m=2)))
    with pytest.raises(UnknownOpError, match="simulator cannot run op 0MYSTERY"):
        simulate_program(program)


def test_deadlock_check_rejects_an_unknown_op():
    program = _with_foreign_op(lower(get("1f1b")(p=2, m=2)))
    with pytest.raises(UnknownOpError, match="deadlock check cannot run op 0MYSTERY"):
        check_deadlock(program)


def test_a_consumer_names_an_op_type_outside_the_table():
    program = _with_foreign_op(lower(get("1f1b")(p=2, m=2)))
    with pytest.raises(UnknownOpError, match="Mystery is not a Program op type"):
        require_known(program.ranks[0], "the runtime (rank 0)", (ACTION, P2P))
    # a known op type that the consumer does not run is also named
    with pytest.raises(UnknownOpError, match="compute-only cannot run op 0SEND_F0"):
        require_known(lower(get("1f1b")(p=2, m=2)).ranks[0], "compute-only", (ACTION,))
