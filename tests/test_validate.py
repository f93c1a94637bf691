"""Validation and lowering: every error names the rank, the action and the fix."""
import pytest

from pipeblocks import schedules
from pipeblocks.core import Comm, DeadlockError, Schedule, ScheduleError, lower, validate


def sched(text: str) -> Schedule:
    return Schedule.from_text(text)


def test_valid_schedule_lowers_with_matching_sends_and_receives():
    program = validate(schedules.get("1f1b")(p=3, m=4))
    sends = sorted(op.key for ops in program.ranks for op in ops if isinstance(op, Comm) and op.send)
    recvs = sorted(op.key for ops in program.ranks for op in ops if isinstance(op, Comm) and not op.send)
    assert sends == recvs and len(sends) == 2 * 2 * 4  # 2 boundaries x (act + grad) x m
    assert "1RECV_F0" in program.to_text() and "0SEND_F0" in program.to_text()


def test_v_turn_hands_over_locally():
    text = "# pipeblocks schedule custom p=2 m=1 stages=0,1,1,0\n0: 0F0 3F0 3BW0 0BW0\n1: 1F0 2F0 2BW0 1BW0\n"
    program = validate(sched(text))
    ops = [str(op) for op in program.ranks[1]]
    assert ops == ["1RECV_F0", "1F0", "2F0", "2SEND_F0", "2RECV_B0", "2BW0", "1BW0", "1SEND_B0"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("0: 0F0 0BW0\n1: 1F0\n", r"rank 1: missing 1BW0"),
        ("0: 0F0 0BW0 0F0\n1: 1F0 1BW0\n", r"0F0 runs more than once"),
        ("0: 0F0 0B0 0BW0 0W0\n1: 1F0 1BW0\n", r"both a fused 0BW0 and split B/W"),
        ("0: 0F0 0B0\n1: 1F0 1BW0\n", r"missing 0W0"),
        ("0: 0BW0 0F0\n1: 1F0 1BW0\n", r"rank 0, action 0 \(0BW0\) runs before 0F0.*move 0BW0 after 0F0"),
        ("0: 0F0 0W0 0B0\n1: 1F0 1BW0\n", r"\(0W0\) runs before 0B0"),
        ("# pipeblocks schedule x p=2 m=1 stages=0,1\n0: 0F0 1F0 0BW0 1BW0\n1: \n", r"stage 1 is placed on rank 1"),
        ("# pipeblocks schedule x p=2 m=1 stages=0,1\n0: 0F0 0F3 0BW0\n1: 1F0 1BW0\n", r"microbatch 3 is out of range for m=1"),
    ],
)
def test_structural_errors(text, message):
    with pytest.raises(ScheduleError, match=message):
        validate(sched(text))


def test_cross_rank_cycle_is_a_deadlock_naming_ranks():
    # rank 0 waits for the gradient of microbatch 0 before it sends microbatch 1's activation,
    # which rank 1 needs before it runs the backward of microbatch 0
    text = "0: 0F0 0BW0 0F1 0BW1\n1: 1F0 1F1 1BW0 1BW1\n"
    with pytest.raises(DeadlockError) as err:
        validate(sched(text))
    message = str(err.value)
    assert "rank 0 blocks at 0RECV_B0" in message and "rank 1 blocks at 1RECV_F1" in message
    assert "reorder" in message


def test_lowering_never_puts_recv_after_its_consumer():
    for name in schedules.names():
        try:
            schedule = schedules.get(name)(p=4, m=8)
        except ScheduleError:
            continue
        for ops in lower(schedule).ranks:
            for i, op in enumerate(ops):
                if isinstance(op, Comm) and not op.send:
                    assert not isinstance(ops[i + 1], Comm), f"{name}: {op} is not followed by its consumer"
