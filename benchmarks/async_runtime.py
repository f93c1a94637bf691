"""Asynchronous against synchronous 1F1B on the runtime, in emulated compute: measured step
time and tokens/s beside the simulator's.

    python benchmarks/async_runtime.py [--p 4] [--n 2 4] [--steps 20] [--emulate 5,5,5] [--json FILE]

Each row runs `pipeblocks train --schedule 1f1b --emulate ...` (every pass sleeps its
modelled time per layer, one layer per stage) and `pipeblocks train --async naive
--emulate ...` on p local processes:

    sync step     the median time of a synchronous step (first two left out)
    async step    the median time between two optimizer steps of a stage, first and last
                  asynchronous step left out (the steady state)
    simulated     the same two from the simulator at the emulated costs
    speed-up      sync step / async step, measured and simulated

A shared or small machine adds the wake-up latency of each transfer to every pass, so
compare the ratios, and rerun when the machine is busy.
"""
from __future__ import annotations

import argparse
import statistics

from pipeblocks.core import simulate, simulate_program, steady_state
from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.models import GPTConfig
from pipeblocks.runtime.emulate import EmulatedCosts
from pipeblocks.schedules import get
from pipeblocks.schedules.asynchronous import async_1f1b
from pipeblocks.train import loop
from pipeblocks.train.asynchronous import run as async_run
from pipeblocks.core.lowering.async_mode import AsyncMode
from pipeblocks.train.run import prepare

from _output import write_json

SKIP = 2  # synchronous steps left out of the median: process start and the shape pass


def measure(p: int, n: int, steps: int, emulate: tuple[float, float, float]) -> dict:
    model = GPTConfig(layers=p)
    costs = CostSpec(times=",".join(map(str, emulate)))
    request = ScheduleRequest(name="1f1b", m=n, mesh=Mesh(pp=p), costs=costs)
    sync_cfg, _ = prepare(request, model=model, emulate=emulate, steps=steps, quiet=True)
    results = loop.launch(sync_cfg)
    spans = [end - start for r in results for step, start, end in r.step_spans if step >= SKIP]
    sync_s = statistics.median(spans)
    async_cfg, _ = prepare(request, model=model, emulate=emulate, steps=steps, quiet=True,
                           async_mode=AsyncMode("naive"))
    async_s = async_run.steady_step_s(loop.launch(async_cfg), 0)
    sim_costs = EmulatedCosts(*emulate, layers=1).sim_costs(get("1f1b")(p=p, m=n))
    sim_sync = simulate(get("1f1b")(p=p, m=n), sim_costs).makespan * 1e-3
    sim_async = steady_state(simulate_program(async_1f1b(p=p, n=n, steps=steps), sim_costs)).step_time * 1e-3
    tokens = sync_cfg.tokens_per_step
    return {
        "p": p, "n": n, "steps": steps, "emulate_ms": list(emulate), "tokens_per_step": tokens,
        "sync_step_s": sync_s, "async_step_s": async_s, "sync_tokens_per_s": tokens / sync_s,
        "async_tokens_per_s": tokens / async_s, "speedup": sync_s / async_s,
        "sim_sync_step_s": sim_sync, "sim_async_step_s": sim_async, "sim_speedup": sim_sync / sim_async,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, nargs="+", default=[4])
    parser.add_argument("--n", type=int, nargs="+", default=[2, 4], help="microbatches per optimizer step")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (6 or more)")
    parser.add_argument("--emulate", default="5,5,5", help="F,B,W milliseconds per layer and microbatch")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON ('-' for stdout)")
    args = parser.parse_args(argv)
    emulate = tuple(float(x) for x in args.emulate.split(","))
    if len(emulate) != 3 or args.steps < 6:
        parser.error("--emulate takes three numbers F,B,W and --steps 6 or more")
    rows = [measure(p, n, args.steps, emulate) for p in args.p for n in args.n]
    print(f"{'p':>3} {'N':>3} {'sync step':>10} {'async step':>10} {'sync tok/s':>10} {'async tok/s':>11} "
          f"{'speed-up':>8} {'simulated: sync':>15} {'async':>7} {'speed-up':>8}")
    for r in rows:
        print(f"{r['p']:>3} {r['n']:>3} {r['sync_step_s'] * 1e3:>8.1f}ms {r['async_step_s'] * 1e3:>8.1f}ms "
              f"{r['sync_tokens_per_s']:>10,.0f} {r['async_tokens_per_s']:>11,.0f} {r['speedup']:>8.2f} "
              f"{r['sim_sync_step_s'] * 1e3:>13.1f}ms {r['sim_async_step_s'] * 1e3:>5.1f}ms {r['sim_speedup']:>8.2f}")
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
