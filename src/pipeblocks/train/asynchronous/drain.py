"""Draining an asynchronous Program early, when the run is asked to stop.

    drain = Drain(shared, step_size=n, stop_requested=lambda: ctx.control.stop_reason is not None)
    drain.before_first_stage_forward(microbatch, segment_end)   # the rank holding stage 0, before F(0, m)
    drain.limit(offset)     # every rank: None, or the first microbatch of the Program that must not run

A stop request (SIGTERM, SIGINT or SIGHUP to the launcher or a rank) is seen by the rank
that holds the first stage, before it lets a microbatch in: it fixes the drain boundary
at the end of the step that microbatch belongs to, (m // n + 1) * n, and publishes it in
memory the launcher shares with every rank (`shared`, a multiprocessing RawValue). From
then on no microbatch at or beyond the boundary enters; every rank skips the ops of those
microbatches (the executor asks the compute object's `microbatch_limit`), and the
microbatches already in flight finish, with their optimizer steps: the Program ends as the
Program of the steps before the boundary would, and every stage has stepped to the same
version (asynchronous/plan.py).

Why the boundary is safe to publish late: a rank posts the receive for a microbatch only
when its next pass is that microbatch's, which needs the first stage to have forwarded
the one before it (asynchronous 1F1B keeps every rank within one microbatch of the first
stage's forwards), so no rank has posted a receive at or beyond m + 1 when the first stage,
about to forward m, decides; the boundary is at least m + 1.
"""
from __future__ import annotations

from collections.abc import Callable

__all__ = ["Drain"]

NONE = -1


class Drain:
    """One rank's view of the run's drain boundary (global microbatch index, NONE: none)."""

    def __init__(self, shared, *, step_size: int, stop_requested: Callable[[], bool]) -> None:
        self.shared = shared
        self.step_size = step_size
        self.stop_requested = stop_requested

    @property
    def boundary(self) -> int | None:
        value = int(self.shared.value) if self.shared is not None else NONE
        return None if value == NONE else value

    def before_first_stage_forward(self, microbatch: int, segment_end: int) -> None:
        """The first stage is about to forward `microbatch` (global index) of a Program whose
        microbatches end before `segment_end`: on a stop request, fix the boundary."""
        if self.shared is None or self.boundary is not None or not self.stop_requested():
            return
        boundary = (microbatch // self.step_size + 1) * self.step_size
        if boundary < segment_end:  # else the Program ends there anyway: the run stops after it
            self.shared.value = boundary

    def limit(self, offset: int) -> int | None:
        """The boundary in the numbering of a Program whose microbatch 0 is `offset`."""
        boundary = self.boundary
        return None if boundary is None else boundary - offset


def shared_boundary():
    """The value a launcher shares with its ranks (created before they start)."""
    import multiprocessing

    return multiprocessing.get_context("spawn").RawValue("q", NONE)
