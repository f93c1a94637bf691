"""The report says when its measured times include contention the simulation does not see."""
from __future__ import annotations

from pipeblocks.train.report import contention_notes, machine_load


def test_ranks_sharing_cores_and_a_busy_machine_are_noted():
    quiet = {"cores": 2, "local_ranks": 2, "load_average": 1.9, "device": "cpu"}
    assert contention_notes(quiet) == []
    shared = contention_notes({**quiet, "local_ranks": 4})
    assert len(shared) == 1 and shared[0].startswith("note: 4 ranks share 2 cores") and "<= 2" in shared[0]
    busy = contention_notes({**quiet, "load_average": 6.3})
    assert len(busy) == 1 and "load average 6.3 on 2 cores" in busy[0]
    assert contention_notes({**quiet, "local_ranks": 4, "device": "cuda"}) == []  # a GPU's ranks have their own
    assert contention_notes({}) == []  # a report from before the fields
    load = machine_load(3, "cpu")
    assert load["local_ranks"] == 3 and load["cores"] >= 1 and load["device"] == "cpu"
