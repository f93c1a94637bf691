"""stop_all ends what was started and skips what never started: a rank whose start
failed must not hide the real failure behind "can only join a started process"."""
from __future__ import annotations

import multiprocessing
import queue

from pipeblocks.runtime import supervise


def test_stop_all_skips_a_rank_that_never_started():
    never_started = multiprocessing.get_context("spawn").Process(target=print)
    supervise.stop_all([never_started], queue.Queue(), interrupt=True)
    assert never_started.pid is None and not never_started.is_alive()
