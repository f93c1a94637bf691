"""`pipeblocks simulate 1f1b -p P -m N --async MODE`: the asynchronous steady state.

The schedule's asynchronous form streams the microbatches of `--async-steps` optimizer
steps (N = m each) without a flush; the figures are per step over the middle steps
(`pipeblocks.core.simulator.steady`), beside the synchronous schedule's step. `weight_memory` is per
rank in units of one stage's weights: the mode's stashes (pipedream) or T2's buffer
(pipemare) included; `weight_memory_sync` is synchronous training's.
"""
from __future__ import annotations

import argparse
import dataclasses

from ..core.simulator.simulate import simulate_program
from ..core.simulator.steady import steady_state
from ..core.lowering.versions import weight_versions
from ..schedules.asynchronous import ASYNC_FORMS
from ..core.lowering.async_mode import (
    DEFAULT_DISCREPANCY_DECAY, DEFAULT_LR_WARMUP_FRACTION, MODES, AsyncMode, weight_memory,
)
from .common import Built, print_json

__all__ = ["ASYNC_FORMS", "add_async_options", "add_mode_options", "mode_from_args", "run_async"]


def add_mode_options(group: argparse._ArgumentGroup, *, what: str) -> None:
    """--async MODE and its settings, shared by `simulate` and `train` (`what` ends --async's help)."""
    group.add_argument(
        "--async", dest="async_mode", choices=MODES, default=None,
        help=f"the schedule's asynchronous form ({', '.join(ASYNC_FORMS)}; no flush, each stage steps its optimizer "
        f"when its share of a step is done) in this mode: {what}",
    )
    group.add_argument(
        "--lr-warmup-steps", type=int, default=None, metavar="K",
        help=f"pipemare's T1: the learning rate divided by the delay at first, back to the run's schedule after K "
        f"optimizer steps (default {DEFAULT_LR_WARMUP_FRACTION:g} of the steps the schedule spans, at least 1; "
        "0: T1 off; a resumed run keeps its checkpoint's)",
    )
    group.add_argument(
        "--discrepancy-decay", type=float, default=None, metavar="D",
        help=f"pipemare's T2 and nesterov's look-ahead: decay in (0, 1] of the weight-velocity average the "
        f"backward corrects with, or the forward looks ahead along (default {DEFAULT_DISCREPANCY_DECAY:g}; 1: off)",
    )
    group.add_argument(
        "--sync-warmup-steps", type=int, default=None, metavar="W",
        help="the first W optimizer steps run synchronously, with a flush after each (any mode; default 0)",
    )


def mode_from_args(args: argparse.Namespace) -> AsyncMode | None:
    """The AsyncMode the options name (None without --async); its settings without --async are an error."""
    given = [f"--{name.replace('_', '-')}" for name in ("lr_warmup_steps", "discrepancy_decay", "sync_warmup_steps")
             if getattr(args, name, None) is not None]
    if args.async_mode is None:
        if given:
            raise ValueError(f"{', '.join(given)} set(s) an asynchronous mode: add --async MODE ({', '.join(MODES)})")
        return None
    return AsyncMode(args.async_mode, sync_warmup_steps=args.sync_warmup_steps or 0,
                     lr_warmup_steps=args.lr_warmup_steps, discrepancy_decay=args.discrepancy_decay)


def add_async_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("asynchronous (PipeDream, PipeMare)")
    add_mode_options(group, what="simulate its steady state and this mode's weight memory")
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
    sync = dataclasses.replace(built, recompute=frozenset(), recompute_at={}).simulate()  # the schedule's own pairs
    versions = weight_versions(program)
    mode = mode_from_args(args)
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
