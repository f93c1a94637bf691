"""`pipeblocks simulate 1f1b -p P -m N --async MODE`: the asynchronous steady state.

The schedule's asynchronous form streams the microbatches of `--async-steps` optimizer
steps (N = m each) without a flush; the figures are per step over the middle steps
(`pipeblocks.core.steady`), beside the synchronous schedule's step. `weight_memory` is per
rank in units of one stage's weights: the mode's stashes (pipedream) or T2's buffer
(pipemare) included; `weight_memory_sync` is synchronous training's.
"""
from __future__ import annotations

import argparse
from types import MappingProxyType

from ..core.simulate import simulate, simulate_program
from ..core.steady import steady_state
from ..core.versions import weight_versions
from ..schedules.asynchronous import async_1f1b
from ..train.async_mode import MODES, AsyncMode, weight_memory
from .common import Built, print_json

__all__ = ["ASYNC_FORMS", "add_async_options", "run_async"]

ASYNC_FORMS = MappingProxyType({"1f1b": async_1f1b})
"""Schedules with an asynchronous form, and the function that builds its Program."""


def add_async_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("asynchronous (PipeDream, PipeMare)")
    group.add_argument(
        "--async", dest="async_mode", choices=MODES, default=None,
        help=f"simulate the steady state of the schedule's asynchronous form ({', '.join(ASYNC_FORMS)}) "
        "and this mode's weight memory",
    )
    group.add_argument(
        "--async-steps", type=int, default=None, metavar="K",
        help="optimizer steps to simulate, 3 or more (default: 4 + 2p/m, past the warm-up)",
    )


def run_async(args: argparse.Namespace, built: Built) -> int:
    schedule = built.schedule
    if schedule.name not in ASYNC_FORMS:
        raise ValueError(
            f"schedule {schedule.name!r} has no asynchronous form: --async runs with {', '.join(ASYNC_FORMS)}"
        )
    if built.costs.data_parallel.dp > 1:
        raise ValueError(f"--async with --dp {built.costs.data_parallel.dp} is not supported yet: use --dp 1")
    if schedule.seq_chunks > 1:
        raise ValueError("--async with sequence chunks is not supported: drop --seq-chunks")
    p, n = schedule.p, schedule.m
    steps = args.async_steps if args.async_steps is not None else 4 + 2 * p // n
    if steps < 3:
        raise ValueError(
            f"--async-steps {steps}: the steady state leaves out the first and the last step, so give 3 or more"
        )
    program = ASYNC_FORMS[schedule.name](p=p, n=n, steps=steps)
    steady = steady_state(simulate_program(program, built.costs))
    sync = simulate(schedule, built.costs)
    versions = weight_versions(program)
    mode = AsyncMode(args.async_mode)
    summary = {
        "schedule": schedule.name, "async": mode.name, "p": p, "m": n, "steps": steps, **steady.summary(),
        "sync_step_time": sync.makespan, "sync_bubble_ratio": sync.bubble_ratio,
        "speedup": sync.makespan / steady.step_time if steady.step_time > 0 else float("inf"),
        "max_delay": [versions.max_delay(s) for s in range(schedule.num_stages)],
        "weight_memory": list(weight_memory(program, mode)),
        "weight_memory_sync": list(weight_memory(program, None)),
    }
    if args.json:
        print_json(summary)
        return 0
    print(f"schedule      asynchronous {schedule.name} ({mode.name}), p={p}, {n} microbatches per step, "
          f"{steps} steps simulated")
    print(f"step time     {steady.step_time:.6g}   (synchronous: {sync.makespan:.6g}, "
          f"{summary['speedup']:.3f}x faster)")
    print(f"bubble        {steady.bubble:.4f} per step in the steady state   "
          f"(synchronous: {sync.bubble_ratio:.4f})")
    print("rank  max delay  weight memory  (synchronous)")
    for r in range(p):
        delays = ",".join(str(summary["max_delay"][s]) for s in schedule.placement.stages_of(r))
        print(f"{r:>4}  {delays:<9}  {summary['weight_memory'][r]:<13.4g}  {summary['weight_memory_sync'][r]:.4g}")
    print("(delays in optimizer steps; weight memory in units of one stage's weights)")
    return 0
