"""The top-level keys that the synchronous and the asynchronous `--report` both carry, with one
meaning, so that a tool reads either without knowing which it has.

    >>> sorted(SHARED_KEYS)[:2]
    ['bubble_ratio_measured', 'bubble_ratio_simulated']
    >>> shared_figures(report)          # the shared keys of a report, as a dict

A synchronous step is one flushed iteration: its figures are medians over the steps after
the warm-up (`train.report`). An asynchronous run has no flush: its figures are the steady
state's, per optimizer step over the middle steps of its longest asynchronous Program
(`train.asynchronous.report`, `core.simulator.steady`), and are null when no such Program ran 3 steps
or more; the same figures stay under `steady_state` with their older names. In both, one
"iteration" is one optimizer step of m microbatches (dp x m over the replicas).
"""
from __future__ import annotations

__all__ = ["SHARED_KEYS", "shared_figures"]

SHARED_KEYS: dict[str, str] = {
    "iteration_time_measured_s":
        "seconds one step's passes take, as measured: synchronous, the median over the timed steps of first pass "
        "start to last pass end; asynchronous, the steady state's time between two optimizer steps (its passes "
        "and optimizer steps overlap the neighbouring steps'; steady_state.step_time_s_measured)",
    "iteration_time_simulated_s":
        "the same, from the simulator's replay of the run's Program with costs profiled from the run",
    "bubble_ratio_measured":
        "idle share of that time on the busiest rank: (time - its busy time) / time, on the measured timeline "
        "(synchronous: the median over the timed steps; asynchronous: steady_state.bubble_measured)",
    "bubble_ratio_simulated":
        "the same on the simulated timeline",
    "step_time_s":
        "wall seconds per optimizer step: synchronous, the median whole step (optimizer included); asynchronous, "
        "the steady state's step time (iteration_time_measured_s: nothing sits between the steps)",
    "tokens_per_s_measured":
        "tokens trained per wall second: tokens per step (all replicas) / step_time_s",
    "steps_timed":
        "how many steps the measured figures are taken over",
    "t_comm_s":
        "the median hand-over between ranks (a pass ending on one rank to the pass that waits for it starting on "
        "another), the simulator's hop time",
    "losses":
        "[{step, loss}] of every step run, step 1-based, on the last stage (the asynchronous report adds "
        "'synchronous' to each: whether that step ran flushed); [] for emulated compute",
}
"""key -> its meaning in both reports (docs/training.md shows the same table)."""


def shared_figures(report: dict) -> dict:
    """The shared keys of a report (synchronous or asynchronous) and their values; a key it
    lacks is a KeyError naming it, as a report written by an older pipeblocks would."""
    missing = [key for key in SHARED_KEYS if key not in report]
    if missing:
        raise KeyError(f"the report lacks {', '.join(missing)}: write it again with this pipeblocks' --report")
    return {key: report[key] for key in SHARED_KEYS}
