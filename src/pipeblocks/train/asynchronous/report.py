"""What an asynchronous run reports: every step's loss, the delays, and the measured steady
state beside the simulator's.

    >>> built = build_async_report(cfg, results)      # results: every rank's AsyncRankResult
    >>> print(format_async_report(built.data))
    >>> write_report(built, "run.json", "run.png")   # --report JSON, --plot timelines (train.report)

The steady state is measured on the longest asynchronous Program of the run that took 3
or more steps (a run with save points or a drain has several): every rank times its
passes and optimizer steps, and `core.simulator.steady.steady_state` reads the same figures off the
measured timeline as off a simulated one (per step over the middle steps, the first
(fill) and the last (drain) left out: step time, busy time, bubble, microbatches/s). The
simulator replays the same Program with costs profiled from those passes (per stage the
median F, fused backward, and optimizer step; the median hand-over between ranks as
t_comm), so `bubble_measured` sits beside `bubble_simulated` for the same run, and
`sync_step_time_simulated_s` gives synchronous 1F1B's step at the same costs. The profiled
costs carry the runtime's time between passes (`report.between_passes`); the simulated
bubble counts it as idle, as the measured one does.

The JSON (`--report FILE`):

    losses              [{"step", "loss", "synchronous"}] of every step run
    delays              per stage: min, max and how many microbatches had each delay
    steady_state        steps, step_time_s / bubble / tokens_per_s, each measured and simulated,
                        busy_per_step_s measured, sync_step_time_simulated_s; null under 3 steps
    first_step, done, drained_at, saved, async_s, warmup_s, tokens_per_step, mode, p, m, steps

and, at the top level, the keys the synchronous report has with the same meaning
(`train.report_keys.SHARED_KEYS`): iteration_time_measured_s / _simulated_s and
bubble_ratio_measured / _simulated (the steady state's step time and bubble), step_time_s,
tokens_per_s_measured, steps_timed, t_comm_s (null without a steady state) and losses.
"""
from __future__ import annotations

import statistics
from collections import Counter

from ...core.ir.actions import Action
from ...core.cost.costs import Costs
from ...core.ir.ops import OptimizerStep
from ...core.simulator.simulate import simulate, simulate_program
from ...core.simulator.steady import SteadyState, steady_state
from ...core.simulator.timeline import Event, Timeline
from ..config import TrainConfig
from ..report import RunReport, between_passes, eval_loss_rows, profiled_costs
from .plan import segment_program
from .steps import AsyncRankResult, SegmentRecord

__all__ = ["build_async_report", "format_async_report"]


def build_async_report(cfg: TrainConfig, results: list[AsyncRankResult]) -> RunReport:
    results = sorted(results, key=lambda r: r.rank)
    n, w = cfg.schedule.m, cfg.async_mode.sync_warmup_steps
    head = results[0]
    losses = next((r.losses for r in results if r.losses), ())
    delays = []
    for r in results:
        for s in r.stages:
            seen = r.delays.get(s, ())[max(0, w - r.first_step) * n:]
            counts = Counter(seen)
            delays.append({"stage": s, "min": min(seen) if seen else None, "max": max(seen) if seen else None,
                           "counts": {str(d): counts[d] for d in sorted(counts)}})
    steady, measured, simulated = _steady(cfg, results)
    data = {
        "schedule": cfg.schedule.name, "mode": cfg.async_mode.describe(), "p": cfg.schedule.p, "m": n,
        "steps": cfg.steps, "first_step": head.first_step, "done": head.done, "drained_at": head.drained_at,
        "saved": list(head.saved), "tokens_per_step": cfg.tokens_per_step, "emulated": cfg.emulation is not None,
        "losses": [{"step": head.first_step + i + 1, "loss": x, "synchronous": head.first_step + i < w}
                   for i, x in enumerate(losses)],
        "eval_losses": eval_loss_rows(results),
        "delays": delays,
        "async_s": max(r.async_s for r in results), "warmup_s": max(r.warmup_s for r in results),
        "steady_state": steady,
        **_shared(steady),
    }
    return RunReport(data, measured, simulated)


def _shared(steady: dict | None) -> dict:
    """The steady state's figures under the synchronous report's names (report_keys.SHARED_KEYS;
    `losses` is at the top level already): one optimizer step is one iteration, since the
    asynchronous run has no flush between them. All null without a steady state."""
    names = {"iteration_time_measured_s": "step_time_s_measured", "iteration_time_simulated_s": "step_time_s_simulated",
             "bubble_ratio_measured": "bubble_measured", "bubble_ratio_simulated": "bubble_simulated",
             "step_time_s": "step_time_s_measured", "tokens_per_s_measured": "tokens_per_s_measured",
             "steps_timed": "steps_measured", "t_comm_s": "t_comm_s"}
    return {key: None if steady is None else steady[nested] for key, nested in names.items()}


def _steady(cfg: TrainConfig, results: list[AsyncRankResult]):
    """(figures, measured timeline, simulated timeline) of the longest asynchronous Program
    of 3 or more steps; (None, None, None) without one."""
    by_rank = [{(rec.segment.first, rec.segment.synchronous): rec for rec in r.segments} for r in results]
    candidates = [rec for rec in results[0].segments if not rec.segment.synchronous and rec.steps_run >= 3]
    if not candidates:
        return None, None, None
    best: SegmentRecord = max(candidates, key=lambda rec: rec.steps_run)
    key = (best.segment.first, False)
    schedule = cfg.schedule.schedule
    ran = type(best.segment)(best.segment.first, best.steps_run, False)
    program = segment_program(schedule, ran)
    rows = [ranks[key].events for ranks in by_rank]
    zero = min(start for row in rows for _, start, _ in row)
    events = tuple(tuple(Event(a, s - zero, e - zero) for a, s, e in row) for row in rows)
    p = len(rows)
    # activations are not counted in an asynchronous run (each forward keeps its stage input only)
    measured_tl = Timeline(schedule=program.schedule, events=events, memory=(((0.0, 0.0),),) * p,
                           peak_activation=(0.0,) * p)
    measured = steady_state(measured_tl)
    stages = schedule.num_stages
    costs = profiled_costs(program.schedule, [measured_tl], [0.0] * stages, [0.0] * stages)
    step_s = [statistics.median([e.end - e.start for row in events for e in row
                                 if type(e.action) is OptimizerStep and e.action.stage == s] or [0.0])
              for s in range(stages)]
    costs = Costs(t_f=costs.t_f, t_b=costs.t_b, t_w=costs.t_w, t_comm=costs.t_comm, t_step=tuple(step_s))
    simulated_tl = simulate_program(program, costs)
    simulated = steady_state(simulated_tl)
    bubble_simulated = _passes_bubble(simulated, simulated_tl, between_passes([measured_tl]), ran.steps)
    sync = simulate(schedule, costs)
    tokens = cfg.tokens_per_step
    figures = {
        "first_step": best.segment.first, "steps": best.steps_run, "steps_measured": measured.steps_measured,
        "step_time_s_measured": measured.step_time, "step_time_s_simulated": simulated.step_time,
        "bubble_measured": measured.bubble, "bubble_simulated": bubble_simulated,
        "busy_per_step_s_measured": measured.busy_per_step,
        "tokens_per_s_measured": tokens / measured.step_time if measured.step_time > 0 else None,
        "tokens_per_s_simulated": tokens / simulated.step_time if simulated.step_time > 0 else None,
        "sync_step_time_simulated_s": sync.makespan,
        "t_comm_s": costs.t_comm,
        "stages": [{"stage": s, "f_s": costs.t_f[s], "bw_s": costs.t_b[s], "step_s": step_s[s]}
                   for s in range(stages)],
    }
    return figures, measured_tl, simulated_tl


def _passes_bubble(state: SteadyState, timeline: Timeline, between: float, steps: int) -> float:
    """The simulated steady-state bubble with the time between passes counted as idle, as the
    measured one counts it (the simulated passes carry it in their durations: profiled_costs;
    the synchronous report's `passes_bubble` does the same). Each rank runs the same passes
    per step in asynchronous 1F1B, so the busiest rank's busy time loses that many gaps."""
    if state.step_time <= 0:
        return 0.0
    passes = max(sum(1 for e in events if type(e.action) is Action) for events in timeline.events) / steps
    return min(1.0, max(0.0, (state.step_time - (state.busy_per_step - between * passes)) / state.step_time))


def format_async_report(data: dict) -> str:
    lines = []
    w = data["mode"]["sync_warmup_steps"]
    if data["losses"] and not data["emulated"]:
        last = data["losses"][-1]
        lines.append(f"loss: step {data['losses'][0]['step']} {data['losses'][0]['loss']:.4f} -> step {last['step']} "
                     f"{last['loss']:.4f}")
    if not data["emulated"]:
        lines.append("stage  delays (min..max, asynchronous steps)  microbatches per delay")
        for row in data["delays"]:
            span = "-" if row["min"] is None else f"{row['min']}..{row['max']}"
            counts = ", ".join(f"{d}: {c}" for d, c in row["counts"].items())
            lines.append(f"{row['stage']:>5}  {span:<38}  {counts}")
    asynchronous = data["done"] - max(w, data["first_step"])
    emulated = " (emulated)" if data["emulated"] else ""
    if asynchronous > 0 and data["async_s"] > 0:
        lines.append(f"asynchronous steps: {asynchronous} in {data['async_s']:.3f} s, "
                     f"{data['tokens_per_step'] * asynchronous / data['async_s']:,.0f} tokens/s{emulated}, "
                     "fill and drain included")
    steady = data["steady_state"]
    if steady is None:
        lines.append("steady state: not measured (no asynchronous Program of 3 or more steps)")
    else:
        lines.append(f"steady state over steps {steady['first_step'] + 1}..{steady['first_step'] + steady['steps']} "
                     f"(the middle {steady['steps_measured']}):")
        lines.append(f"  step time  measured {steady['step_time_s_measured'] * 1e3:8.1f} ms   simulated "
                     f"{steady['step_time_s_simulated'] * 1e3:8.1f} ms   (synchronous 1F1B simulated "
                     f"{steady['sync_step_time_simulated_s'] * 1e3:.1f} ms)")
        lines.append(f"  bubble     measured {steady['bubble_measured']:8.3f}      simulated "
                     f"{steady['bubble_simulated']:8.3f}")
        lines.append(f"  tokens/s   measured {steady['tokens_per_s_measured']:8,.0f}      simulated "
                     f"{steady['tokens_per_s_simulated']:8,.0f}{emulated}")
    if w and data["warmup_s"] > 0:
        done_sync = max(0, min(w, data["done"]) - data["first_step"])
        if done_sync:
            lines.append(f"synchronous warm-up: {done_sync} steps in {data['warmup_s']:.3f} s, "
                         f"{data['tokens_per_step'] * done_sync / data['warmup_s']:,.0f} tokens/s{emulated}")
    if data["drained_at"] is not None:
        lines.append(f"drained at step {data['drained_at']} on a stop request")
    if data["saved"]:
        lines.append(f"checkpoints: steps {data['saved']}")
    return "\n".join(lines)
