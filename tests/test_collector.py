"""The cyclic collector's pause around generation and simulation: restored afterwards,
nothing made meanwhile left uncollectable, a caller's frozen objects left frozen."""
from __future__ import annotations

import gc
import weakref

from pipeblocks.core.simulator.collector import collector_paused


class _Node:
    def __init__(self) -> None:
        self.other = self


def test_pause_restores_the_collector_and_nests():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # only the outermost pause re-enables
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller's own disable is kept
    finally:
        gc.enable()


def test_cycles_made_in_a_pause_are_still_collected():
    with collector_paused():
        node = _Node()
    ref = weakref.ref(node)
    del node
    gc.collect()
    assert ref() is None
    assert gc.get_freeze_count() == 0


def test_a_callers_frozen_objects_stay_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with collector_paused():
            _Node()
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
