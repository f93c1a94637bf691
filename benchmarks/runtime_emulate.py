"""Runtime overhead with emulated compute: measured vs simulated makespan and bubble.

    PYTHONPATH=src python benchmarks/runtime_emulate.py --p 4 --m 8 --f 4 --b 4 --w 4

Every action sleeps its modelled cost (ms per layer; the model has 2p layers cut into
the schedule's stages) while activations of a real shape cross gloo. The table compares
the measured Timeline of the last step with the simulator under the same costs: the gap
is the runtime's own overhead (Python, communication, scheduling on this machine).
"""
from __future__ import annotations

import argparse

import torch

from pipeblocks import schedules
from pipeblocks.runtime import PipelineRunner, spawn
from pipeblocks.runtime.emulate import EmulatedCompute, EmulatedCosts
from _toy import toy_schedules
from pipeblocks.models.toy import ToyConfig, cross_entropy, toy_batch, toy_stages
from pipeblocks.sim import simulate


def _worker(ctx, names, p, m, costs, config, steps):
    out = {}
    for name in names:
        schedule = schedules.get(name)(p=p, m=m)
        stages = toy_stages(schedule.num_stages, ToyConfig(vocab=config.vocab, hidden=config.hidden, seq=config.seq))
        mine = {s: stages[s] for s in schedule.placement.stages_of(ctx.rank)}
        per_stage = EmulatedCosts(costs.f_ms, costs.b_ms, costs.w_ms, layers=2 * p // schedule.num_stages)
        compute = EmulatedCompute(per_stage, mine, schedule.num_stages)
        runner = PipelineRunner(schedule, mine, cross_entropy, timeout_s=120, compute=compute, record_timeline=True)
        x, y = toy_batch(2 * m, config)
        results = [runner.step(x, y) for _ in range(steps)]
        last = results[-1]
        if last.timeline is not None:
            out[name] = {
                "makespan_ms": last.timeline.makespan * 1e3,
                "bubble": last.timeline.bubble_ratio,
                "events": sum(len(e) for e in last.timeline.events),
            }
        out.setdefault("_wait", {})[name] = last.wait_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--f", type=float, default=4.0, help="forward ms per layer")
    parser.add_argument("--b", type=float, default=4.0, help="input-gradient ms per layer")
    parser.add_argument("--w", type=float, default=4.0, help="weight-gradient ms per layer")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedules", default="", help="comma-separated names (default: all that build)")
    args = parser.parse_args()
    wanted = args.schedules.split(",") if args.schedules else schedules.names()
    names = toy_schedules(args.p, args.m, wanted)
    config = ToyConfig(vocab=32, hidden=args.hidden, seq=args.seq)
    costs = EmulatedCosts(args.f, args.b, args.w)
    results = spawn(_worker, args.p, args=(names, args.p, args.m, costs, config, args.steps), timeout_s=600,
                    threads_per_rank=1)
    measured = results[0]
    waits = [r["_wait"] for r in results]
    print(f"p={args.p} m={args.m} F/B/W={args.f}/{args.b}/{args.w} ms per layer, 2p layers, "
          f"activation float64[2, {args.seq}, {args.hidden}] ({2 * args.seq * args.hidden * 8 / 1024:.0f} KiB)")
    print(f"{'schedule':18s} {'sim ms':>8s} {'run ms':>8s} {'overhead':>9s} {'sim bubble':>10s} {'run bubble':>10s} "
          f"{'max wait ms':>11s}")
    for name in names:
        schedule = schedules.get(name)(p=args.p, m=args.m)
        per_stage = EmulatedCosts(args.f, args.b, args.w, layers=2 * args.p // schedule.num_stages)
        sim = simulate(schedule, per_stage.sim_costs(schedule))
        run = measured[name]
        print(f"{name:18s} {sim.makespan:8.1f} {run['makespan_ms']:8.1f} "
              f"{(run['makespan_ms'] / sim.makespan - 1) * 100:8.1f}% {sim.bubble_ratio:10.3f} {run['bubble']:10.3f} "
              f"{max(w[name] for w in waits) * 1e3:11.1f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
