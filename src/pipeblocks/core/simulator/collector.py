"""Pausing Python's cyclic garbage collector around allocation-heavy work."""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Generation and simulation allocate millions of small objects (actions, events,
    tuples) and make no reference cycles; the cyclic collector, triggered by the allocation
    count, would walk the caller's whole heap again and again (a third of a large
    generator's time, twice a large simulation's). Nests: only the outermost re-enables."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if not gc.get_freeze_count():
                # Re-enabled as is, the collector would walk every object made meanwhile
                # (millions) at the next allocation, and again as they age. Freezing and
                # unfreezing moves them to the oldest generation without walking them and
                # resets the young count; they stay collectable (at the next full collection).
                # Skipped when the caller froze objects of its own: unfreeze would release them.
                gc.freeze()
                gc.unfreeze()
            gc.enable()
