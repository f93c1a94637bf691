"""Emulated compute: the Program runs with sleeps for compute and real tensors on the wire,
and the measured Timeline is a sim Timeline that follows the schedule's order."""
from __future__ import annotations

import pytest

from pipeblocks.runtime import spawn
from pipeblocks.runtime.emulate import EmulatedCosts
from pipeblocks.sim import simulate

from _runtime_cases import build, emulate_worker

pytestmark = pytest.mark.spawn

MS = 20.0


def test_emulated_timeline_follows_schedule_and_model():
    name, p, m = "zb-h1", 2, 4
    timelines = spawn(emulate_worker, p, args=(name, m, MS), timeout_s=120, threads_per_rank=1)
    measured = timelines[0]
    assert timelines[1] is None, "the Timeline is gathered on rank 0 only"
    schedule = build(name, p, m)
    for rank, events in enumerate(measured.events):
        assert [e.action for e in events] == list(schedule.ranks[rank]), "actions ran in the schedule's order"
        for event in events:
            want = MS * (2 if event.action.kind.value == "BW" else 1) / 1000
            assert event.end - event.start >= want * 0.95, f"{event.action} slept its modelled cost"
    # each pass waited for its input: stage 1's F after stage 0's, stage 0's B after stage 1's
    # (order and waits, not durations: how long the machine's load stretched the step varies)
    when = {(e.action.kind.value, e.action.stage, e.action.microbatch): e for events in measured.events
            for e in events}
    for mb in range(m):
        assert when[("F", 1, mb)].start >= when[("F", 0, mb)].end, f"F of microbatch {mb} ran before its input came"
        assert when[("B", 0, mb)].start >= when[("B", 1, mb)].end, f"B of microbatch {mb} ran before its gradient came"
    predicted = simulate(schedule, EmulatedCosts(MS, MS, MS).sim_costs(schedule)).makespan / 1000
    assert measured.makespan >= predicted * 0.95  # no pass can be shorter than its sleep
