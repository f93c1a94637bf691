"""Workers for the spawn-level life-cycle tests (module level: spawned processes import them)."""
from __future__ import annotations

import time

__all__ = ["beating_worker"]


def beating_worker(ctx, steps: int, step_s: float, hang_after: int | None) -> tuple[str, int]:
    """Report `steps` steps of `step_s` each; after step `hang_after`, hang (no more reports)."""
    for done in range(1, steps + 1):
        time.sleep(step_s)
        if ctx.control.step_done(done):
            return ("stopped", done)
        if done == hang_after:
            time.sleep(600)
    return ("done", steps)
