"""Invariant 5: nothing hangs. A failing rank stops every rank promptly with its error; a
shape mismatch is a clear error at the first step; a silent peer times out; bad input is a
ValueError before launch."""
from __future__ import annotations

import time

import pytest

from pipeblocks import schedules
from pipeblocks.runtime import RankFailedError, spawn

from _runtime_cases import bad_input_worker, dying_worker, mismatch_worker, raising_worker, silent_peer_worker

pytestmark = pytest.mark.spawn


def test_raising_rank_stops_all_ranks_with_its_error():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        spawn(raising_worker, 3, args=(1, 120.0), timeout_s=120, threads_per_rank=1)
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    assert "stage exploded on purpose" in str(info.value)
    assert "1F2" in str(info.value), "the error names the failing action"
    # the peers would wait 120 s for rank 1; stopping them must not wait for that
    assert elapsed < 60, f"took {elapsed:.1f} s"


def test_shape_mismatch_is_a_clear_error_at_the_first_step():
    with pytest.raises(RankFailedError) as info:
        spawn(mismatch_worker, 2, timeout_s=120, threads_per_rank=1)
    message = str(info.value)
    assert info.value.rank == 1
    assert "SpecMismatchError" in message
    assert "stage 1 (rank 1) cannot take the output of stage 0, float64[2, 5, 8]" in message


def test_silent_peer_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        spawn(silent_peer_worker, 2, args=(3.0,), timeout_s=120, threads_per_rank=1)
    assert info.value.rank == 0
    assert "PeerTimeoutError" in str(info.value) and "timed out after 3 s" in str(info.value)
    assert time.monotonic() - start < 60


def test_rank_dying_without_a_word_stops_the_job():
    with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) exited with code 3"):
        spawn(dying_worker, 2, timeout_s=120, threads_per_rank=1)


def test_bad_arguments_are_value_errors():
    schedule = schedules.get("1f1b")(p=3, m=4)
    with pytest.raises(ValueError, match="needs p=3 processes but 2 would be launched"):
        spawn(bad_input_worker, 2, schedule=schedule)
    (first, _second) = spawn(bad_input_worker, 2, timeout_s=120, threads_per_rank=1)
    assert "rank 0 holds stages [0]" in first and "but stages [1] were given" in first
    assert "inputs has 3 microbatches but the schedule has m=4" in first
