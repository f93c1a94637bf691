"""DP ops (UNSHARD, RESHARD, REDUCE_GRAD): text form, sharding policies and the lowering
passes' placement."""
from __future__ import annotations

import pytest

from pipeblocks.core import (
    PASSES,
    DPOp,
    Program,
    ShardingPolicy,
    check_deadlock,
    check_dp_ops,
    dp_passes,
    lower,
    parse_sharding,
    per_stage,
)
from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.resolve.request import Mesh, ScheduleRequest
from pipeblocks.core.ir.ops import DP, Stream, op_type, parse_op
from pipeblocks.schedules import get


def _lowered(name: str, policies: str, dp: int = 2, **kw) -> Program:
    schedule = get(name)(**kw)
    return lower(schedule, passes=PASSES + dp_passes(parse_sharding(policies), dp))


def test_dp_op_text_round_trips_and_sits_on_the_communication_stream():
    schedule = get("1f1b")(p=3, m=4)
    for text in ("2UNSHARD", "0RESHARD", "1REDUCE_GRAD"):
        op = parse_op(text, schedule)
        assert isinstance(op, DPOp) and str(op) == text
    assert parse_op("1REDUCE_GRAD", schedule) == DPOp("REDUCE_GRAD", 1)
    assert op_type(DPOp("UNSHARD", 0)) is DP and DP.stream is Stream.COMMUNICATION
    with pytest.raises(ScheduleError, match="stage 3 does not exist"):
        parse_op("3UNSHARD", schedule)


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "interleaved-1f1b", "seq1f1b"])
def test_lowered_program_with_dp_ops_round_trips_and_validates(name):
    program = _lowered(name, "zero3", p=3, m=6)
    assert Program.from_text(program.to_text(), program.schedule) == program
    check_deadlock(program)
    check_dp_ops(program, parse_sharding("zero3"))
    # one REDUCE_GRAD and one UNSHARD/RESHARD pair per stage
    for kind in ("REDUCE_GRAD", "UNSHARD", "RESHARD"):
        stages = sorted(op.stage for ops in program.ranks for op in ops if isinstance(op, DPOp) and op.kind == kind)
        assert stages == list(range(program.schedule.num_stages))


def test_1f1b_zero3_placement_in_text_form():
    program = _lowered("1f1b", "zero3", p=2, m=2)
    assert program.to_text() == (
        "0: 0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0BW0 0RECV_B1 0BW1 0REDUCE_GRAD 0RESHARD\n"
        "1: 1UNSHARD 1RECV_F0 1F0 1BW0 1SEND_B0 1RECV_F1 1F1 1BW1 1SEND_B1 1REDUCE_GRAD 1RESHARD\n"
    )


def test_grad_reduce_follows_the_last_weight_gradient_and_its_sends():
    # zb-v p=2 m=4: stage 3's last W (3W3) comes before stage 0's; stage 1 ends with 1W3
    program = _lowered("zb-v", "replicate", p=2, m=4)
    rank0 = " ".join(map(str, program.ranks[0]))
    assert "3W3 3REDUCE_GRAD 0RECV_B2" in rank0 and rank0.endswith("0W3 0REDUCE_GRAD")
    rank1 = " ".join(map(str, program.ranks[1]))
    assert "2W3 2REDUCE_GRAD 1W3 1REDUCE_GRAD" in rank1
    # fused backward with a send after it: the reduction goes after the send
    text = _lowered("1f1b", "replicate", p=2, m=2).to_text()
    assert "1BW1 1SEND_B1 1REDUCE_GRAD" in text
    # with sequence chunks, after the last chunk's pass
    seq = _lowered("seq1f1b", "replicate", p=2, m=2)
    last = [str(op) for op in seq.ranks[0]]
    assert last[-1] == "0REDUCE_GRAD" and last[-2].startswith("0BW1.")


def test_unshard_is_prefetched_one_stage_ahead():
    # interleaved-1f1b p=2 m=4, rank 0 holds stages 0 and 2: both gathers at the start of
    # the step (2's no longer waits until one compute action before 2F0)
    program = _lowered("interleaved-1f1b", "zero3", p=2, m=4)
    rank0 = " ".join(map(str, program.ranks[0]))
    assert rank0.startswith("0UNSHARD 2UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0")
    # three stages per rank: the third is gathered where the rank starts on the second
    # (before 2F0's receive), not one action before its own first pass
    three = " ".join(map(str, _lowered("interleaved-1f1b", "zero3", p=2, m=4, v=3).ranks[0]))
    assert "0F1 0SEND_F1 4UNSHARD 2RECV_F0 2F0" in three, three
    assert "2REDUCE_GRAD 2RESHARD" in rank0
    # per-chunk policies: only the zero3 stages are gathered
    mixed = _lowered("interleaved-1f1b", "zero3,replicate,replicate,zero3", p=2, m=4)
    gathered = sorted(op.stage for ops in mixed.ranks for op in ops if op == DPOp("UNSHARD", op.stage))
    assert gathered == [0, 3]


def test_passes_are_added_only_when_needed():
    assert dp_passes(parse_sharding("replicate"), 1) == ()
    assert [p.__name__ for p in dp_passes(parse_sharding("replicate"), 2)] == ["add_grad_reduce"]
    assert [p.__name__ for p in dp_passes(parse_sharding("zero2"), 1)] == ["add_grad_reduce"]
    assert [p.__name__ for p in dp_passes(parse_sharding("zero3"), 2)] == ["add_sharding", "add_grad_reduce"]
    # the passes commute with add_p2p: the same program either way
    schedule = get("zb-v")(p=2, m=4)
    passes = dp_passes(parse_sharding("zero3"), 2)
    assert lower(schedule, passes=PASSES + passes) == lower(schedule, passes=passes + PASSES)


def test_policy_parsing_and_length_errors():
    assert parse_sharding("zero3,Replicate") == (ShardingPolicy.ZERO3, ShardingPolicy.REPLICATE)
    assert per_stage(parse_sharding("zero2"), 3) == (ShardingPolicy.ZERO2,) * 3
    with pytest.raises(ValueError, match="unknown policy 'zero4'"):
        parse_sharding("zero1,zero4")
    with pytest.raises(ValueError, match="gives 3 policies but the schedule has 4 chunks"):
        per_stage(parse_sharding("zero1,zero2,zero3"), 4)
    with pytest.raises(ValueError, match="gives 3 policies but the schedule has 4 chunks"):
        _lowered("zb-v", "zero3,zero3,replicate", p=2, m=4)
    request = ScheduleRequest(name="1f1b", m=4, mesh=Mesh(pp=2, dp=2), sharding="zero3")
    assert request.sharding == (ShardingPolicy.ZERO3,)


def test_check_dp_ops_names_misplaced_ops():
    program = _lowered("1f1b", "zero3", p=2, m=2)
    ranks = [list(ops) for ops in program.ranks]
    ranks[0].remove(DPOp("UNSHARD", 0))
    broken = Program(program.schedule, tuple(map(tuple, ranks)))
    with pytest.raises(ScheduleError, match="rank 0, op 0 \\(0F0\\): stage 0's parameters are sharded"):
        check_dp_ops(broken, parse_sharding("zero3"))
    with pytest.raises(ScheduleError, match="op 9 \\(0RESHARD\\): stage 0 is not gathered"):
        check_dp_ops(broken)  # without the policies, the unmatched RESHARD is what is wrong
    ranks = [list(ops) for ops in program.ranks]
    ranks[1].insert(1, DPOp("REDUCE_GRAD", 1))
    early = Program(program.schedule, tuple(map(tuple, ranks)))
    with pytest.raises(ScheduleError, match="runs after 1REDUCE_GRAD"):
        check_dp_ops(early)


def test_every_registered_schedule_lowers_and_simulates_with_dp_ops():
    from pipeblocks.core import Costs, simulate
    from pipeblocks.core.cost.dp_model import DPCostModel
    from pipeblocks.schedules import names

    for name in names():
        schedule = get(name)(p=2, m=4)
        program = lower(schedule, passes=PASSES + dp_passes(parse_sharding("zero3"), 2))
        check_deadlock(program)
        check_dp_ops(program, parse_sharding("zero3"))
        timeline = simulate(schedule, Costs(data_parallel=DPCostModel(dp=2, sharding=parse_sharding("zero3"))))
        assert all(len(evs) == 2 * len(schedule.placement.stages_of(r)) for r, evs in enumerate(timeline.comm_events))
