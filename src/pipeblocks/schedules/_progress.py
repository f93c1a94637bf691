"""Progress of long generator runs, through the `logging` module (logger
"pipeblocks.schedules", level INFO), so the schedules layer never prints: an application
shows it by configuring logging, e.g. `logging.basicConfig(level=logging.INFO)`.

A step is reported only once its build has run for more than `after` seconds, so small
builds stay silent.
"""
from __future__ import annotations

import logging
import time

__all__ = ["Progress"]

_LOG = logging.getLogger("pipeblocks.schedules")


class Progress:
    """Reports the steps of one build (`step(message)`) once it has taken `after` seconds."""

    def __init__(self, name: str, *, after: float = 2.0) -> None:
        self.name = name
        self.after = after
        self.started = time.monotonic()

    def step(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        if elapsed > self.after and _LOG.isEnabledFor(logging.INFO):
            _LOG.info("%s: %s (%.1f s)", self.name, message, elapsed)
