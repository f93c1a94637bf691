"""IR, text form, JSON, placement."""
import json

import pytest

from pipeblocks import schedules
from pipeblocks.core import Action, Kind, Placement, Schedule, ScheduleError, parse_actions


@pytest.mark.parametrize("text", ["2F5", "0B3", "1W3", "0BW2", "0B3.1", "12F105.3"])
def test_action_text_round_trips(text):
    action = Action.parse(text)
    assert str(action) == text
    assert Action.parse(str(action)) == action


def test_action_fields():
    a = Action.parse("0B3.1")
    assert (a.stage, a.kind, a.microbatch, a.seq_chunk) == (0, Kind.B, 3, 1)
    assert Action.parse("7BW2").kind is Kind.BW


@pytest.mark.parametrize("bad", ["", "F5", "2X5", "2F", "2F5.", "-1F2", "2 F5", "2FB5"])
def test_bad_action_text_is_a_clear_error(bad):
    with pytest.raises(ScheduleError, match="expected <stage><F|B|W|BW><microbatch>"):
        Action.parse(bad)


def test_placements():
    assert Placement.loop(2, 2).stage_to_rank == (0, 1, 0, 1)
    v = Placement.v_shape(3)
    assert v.stage_to_rank == (0, 1, 2, 2, 1, 0)
    assert v.stages_of(0) == (0, 5) and v.stage_fraction == 0.5
    with pytest.raises(ScheduleError, match="different stage counts"):
        Placement((0, 0, 1))
    with pytest.raises(ScheduleError, match="without a stage"):
        Placement((0, 2))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "bfs"])
def test_schedule_text_and_json_round_trip(name, tmp_path):
    schedule = schedules.get(name)(p=3, m=5)
    back = Schedule.from_text(schedule.to_text())
    assert back.ranks == schedule.ranks and back.placement == schedule.placement and back.m == 5
    again = Schedule.from_json(json.loads(json.dumps(schedule.to_json())))
    assert again == schedule
    for suffix in (".json", ".txt"):
        path = tmp_path / f"s{suffix}"
        schedule.save(path)
        loaded = Schedule.load(path)
        assert loaded.ranks == schedule.ranks and loaded.placement == schedule.placement


def test_text_without_header_infers_placement():
    schedule = Schedule.from_text("0: 0F0 0F1 0BW0 0BW1\n1: 1F0 1BW0 1F1 1BW1\n")
    assert schedule.p == 2 and schedule.m == 2 and schedule.placement.stage_to_rank == (0, 1)


@pytest.mark.parametrize(
    "text, message",
    [
        ("0: 0F0 0BW0\n0: 0F1\n", "listed twice"),
        ("0: 0F0 0BW0\n2: 1F0 1BW0\n", r"lacks rank\(s\) \[1\]"),
        ("# nothing\n", "no rank lines"),
        ("zero: 0F0\n", "expected '<rank>: <actions>'"),
        ("0: 0F0 1F0\n1: 1BW0 0BW0\n", "appears on ranks 0 and 1"),
    ],
)
def test_malformed_schedule_text(text, message):
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_text(text)


def test_malformed_schedule_files(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    with pytest.raises(ScheduleError, match="not valid JSON"):
        Schedule.load(bad_json)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"format": "something-else"}')
    with pytest.raises(ScheduleError, match="not a pipeblocks schedule"):
        Schedule.load(wrong)
    with pytest.raises(ScheduleError, match="cannot read schedule file"):
        Schedule.load(tmp_path / "missing.txt")


def test_parse_actions_list():
    assert [str(a) for a in parse_actions(" 0F0  0B0\n0W0 ")] == ["0F0", "0B0", "0W0"]
