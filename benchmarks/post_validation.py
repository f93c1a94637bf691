"""Optimizer post-validation against a barrier: the time the optimistic step saves.

    PYTHONPATH=src python benchmarks/post_validation.py [--p 2 3 4] [--steps 12] [--repeats 3] [--json out.json]

Both modes clip by the global gradient norm (`PostValidator`, max_norm large enough that
no step clips: the common case) and differ only in when the optimizer steps:

  barrier     all-reduce the squared norms, wait for it, then step;
  optimistic  start the all-reduce, step at once, then wait for it (undoing only when the
              check fails, which it never does here).

Measured (gloo, p local processes): the runner executes the schedule with emulated
compute (each pass sleeps its cost per layer, real activations cross gloo), so the CPU is
left to what is compared: every rank then installs fixed gradients and runs a real AdamW
step over the real parameters of its stages (a GPT of --hidden width). The modes alternate
within one launch, `--repeats` times each; a mode's time per step is the wall time from
the first rank starting the first timed step to the last rank finishing the last one, over
the timed steps (the first `--warmup` are dropped): the median over repeats, and the best
run of each mode (the least disturbed by other load on the machine). Also measured: the
optimizer step alone (t_opt, barrier mode, after the wait) and a scalar all-reduce between
ranks already in step (t_ar).

Simulated: the simulator's timeline of the same schedule and per-stage costs gives each
rank's end of its last backward, e_r. The model: with a barrier every rank is ready for
the next step at max(e) + t_ar + t_opt (it waits for the slowest rank's last backward and
the all-reduce, then steps); optimistically rank r is ready at max(e_r + t_opt,
max(e) + t_ar) (it steps alone, then its wait for the all-reduce overlaps the step). The
next step cannot start on rank r before it is ready, so the iteration time is
max_r(ready_r - s_r), s_r being rank r's first start in the simulated step (the next step
is the same timeline shifted; delays a late rank passes on downstream are ignored, so this
is a lower bound). `barrier wait` is what the barrier adds to each rank's step: the mean
over ranks of max(e) - e_r + t_ar. A flushed schedule ends with the backward of stage 0 on
rank 0, so that rank gates the next step and the saving per step is min(t_opt, t_ar) plus
whatever later ranks' delayed steps would hold up their first forward.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from pipeblocks import schedules
from pipeblocks.models import GPTConfig, build_stages, cross_entropy
from pipeblocks.core.cost.split import layer_counts
from pipeblocks.runtime import PipelineRunner, spawn
from pipeblocks.runtime.emulate import EmulatedCompute, EmulatedCosts
from pipeblocks.sim import simulate
from pipeblocks.train.post_validation import PostValidator

MODES = ("barrier", "optimistic")


def _worker(ctx, name, p, m, f_ms, b_ms, w_ms, hidden, steps, warmup, repeats):
    schedule = schedules.get(name)(p=p, m=m)
    S = schedule.num_stages
    model = GPTConfig(layers=S, hidden=hidden, heads=4, seq=8, vocab=256)
    mine = schedule.placement.stages_of(ctx.rank)
    stages = {s.index: s for s in build_stages(model, seed=0, num_stages=S, stages=mine)}
    costs = EmulatedCosts(f_ms, b_ms, w_ms, layers=layer_counts(model.layers, S))
    runner = PipelineRunner(schedule, stages, cross_entropy, timeout_s=120,
                            compute=EmulatedCompute(costs, stages, S), measure_memory=False)
    params = [q for s in stages.values() for q in s.parameters()]
    generator = torch.Generator().manual_seed(ctx.rank)
    fixed = [torch.randn(q.shape, generator=generator, dtype=q.dtype) * 1e-3 for q in params]
    x = torch.randint(0, model.vocab, (m, model.seq))
    # a scalar all-reduce between ranks already in step
    probe, ar = torch.zeros(1, dtype=torch.float64), []
    for _ in range(30):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(probe)
        ar.append(time.perf_counter() - t)
    runs = []
    for _ in range(repeats):
        for mode in MODES:
            optimizer = torch.optim.AdamW(params, lr=1e-4)
            validator = PostValidator(optimizer, max_norm=1e9, optimistic=mode == "optimistic", timeout_s=120)
            spans, opt = [], []
            dist.barrier()
            for _ in range(steps):
                t0 = time.perf_counter()
                runner.step(x if runner.holds_first_stage else None, x if runner.holds_last_stage else None)
                for q, g in zip(params, fixed):
                    q.grad = g
                tb = time.perf_counter()
                check = validator.step()
                t1 = time.perf_counter()
                if check.outcome != "stepped" or check.rolled_back:
                    raise RuntimeError(f"rank {ctx.rank}: a step was {check.outcome}: the modes must not clip")
                spans.append((t0, t1))
                opt.append(t1 - tb - check.wait_s)
            runs.append({"mode": mode, "spans": spans[warmup:], "t_opt": statistics.median(opt[warmup:])})
    return {"rank": ctx.rank, "t_ar": statistics.median(ar), "runs": runs}


def measure(name, p, m, f_ms, b_ms, w_ms, hidden, steps, warmup, repeats) -> dict:
    ranks = spawn(_worker, p, args=(name, p, m, f_ms, b_ms, w_ms, hidden, steps, warmup, repeats),
                  timeout_s=600, threads_per_rank=1)
    per_mode: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i, run in enumerate(ranks[0]["runs"]):
        first = min(r["runs"][i]["spans"][0][0] for r in ranks)
        last = max(r["runs"][i]["spans"][-1][1] for r in ranks)
        per_mode[run["mode"]].append((last - first) / len(run["spans"]))
    t_opt = statistics.median(r["t_opt"] for rank in ranks for r in rank["runs"] if r["mode"] == "barrier")
    t_ar = statistics.median(rank["t_ar"] for rank in ranks)
    return {"step_s": {mode: statistics.median(v) for mode, v in per_mode.items()},
            "best_s": {mode: min(v) for mode, v in per_mode.items()},
            "runs_s": per_mode, "t_opt_s": t_opt, "t_ar_s": t_ar}


def simulated(name, p, m, f_ms, b_ms, w_ms, layers, t_opt, t_ar) -> dict:
    schedule = schedules.get(name)(p=p, m=m)
    costs = EmulatedCosts(f_ms, b_ms, w_ms, layers=layer_counts(layers, schedule.num_stages)).sim_costs(schedule)
    timeline = simulate(schedule, costs)
    ends = [events[-1].end / 1e3 for events in timeline.events]  # ms -> s
    starts = [events[0].start / 1e3 for events in timeline.events]
    last = max(ends)
    barrier = [last + t_ar + t_opt] * p
    optimistic = [max(e + t_opt, last + t_ar) for e in ends]
    return {
        "barrier_s": max(r - s for r, s in zip(barrier, starts)),
        "optimistic_s": max(r - s for r, s in zip(optimistic, starts)),
        "barrier_wait_s": statistics.mean(last - e + t_ar for e in ends),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--p", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--m", type=int, default=None, help="microbatches (default 2p)")
    parser.add_argument("--costs", default="2,2,1", help="emulated F,B,W ms per layer (default 2,2,1)")
    parser.add_argument("--hidden", type=int, default=384, help="GPT width: sets the optimizer step's cost")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    f_ms, b_ms, w_ms = (float(v) for v in args.costs.split(","))
    rows = []
    for p in args.p:
        m = args.m or 2 * p
        got = measure(args.schedule, p, m, f_ms, b_ms, w_ms, args.hidden, args.steps, args.warmup, args.repeats)
        layers = schedules.get(args.schedule)(p=p, m=m).num_stages
        sim = simulated(args.schedule, p, m, f_ms, b_ms, w_ms, layers, got["t_opt_s"], got["t_ar_s"])
        rows.append({"schedule": args.schedule, "p": p, "m": m, **got, "simulated": sim})
    print(f"{args.schedule}, emulated F,B,W = {args.costs} ms per layer, one layer per stage, GPT hidden "
          f"{args.hidden}; ms per step (measured over {args.repeats} runs of {args.steps - args.warmup} steps: "
          "median, and best run; ratio = optimistic / barrier)")
    print(f"{'p':>2} {'m':>3} {'t_opt':>6} {'t_ar':>6} | {'measured: barrier':>17} {'optimistic':>10} {'ratio':>6} "
          f"{'best ratio':>10} | {'simulated: barrier':>18} {'optimistic':>10} {'ratio':>6} {'barrier wait':>12}")
    for r in rows:
        meas, best, sim = r["step_s"], r["best_s"], r["simulated"]
        print(f"{r['p']:>2} {r['m']:>3} {r['t_opt_s'] * 1e3:6.2f} {r['t_ar_s'] * 1e3:6.2f} | "
              f"{meas['barrier'] * 1e3:17.2f} {meas['optimistic'] * 1e3:10.2f} "
              f"{meas['optimistic'] / meas['barrier']:6.3f} {best['optimistic'] / best['barrier']:10.3f} | "
              f"{sim['barrier_s'] * 1e3:18.2f} "
              f"{sim['optimistic_s'] * 1e3:10.2f} {sim['optimistic_s'] / sim['barrier_s']:6.3f} "
              f"{sim['barrier_wait_s'] * 1e3:12.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
