"""Asynchronous 1F1B against synchronous 1F1B, simulated: per-step bubble and throughput,
the delays each stage sees, and the weight memory of each training mode.

    python benchmarks/async_steady_state.py [--p 4 8] [--n 1 2 4 8] [--steps K] [--costs 1,2,0] [--json FILE]

Costs are pass times TF,TB,TW (fused BW = TB + TW); unit costs by default.

    sync bubble    1F1B with a flush after every step of N microbatches: bubble_ratio
    async bubble   asynchronous 1F1B over --steps steps, measured over the middle steps
    speed-up       async throughput / sync throughput (microbatches per time unit)
    delays         per stage, its largest delay in optimizer steps (steady state)
    weights        per rank, weight-sized buffers: pipedream (stashes) / pipemare (T2's buffer);
                   naive and synchronous training keep 1
"""
from __future__ import annotations

import argparse
import sys

from pipeblocks.core import parse_costs, simulate, simulate_program, steady_state, weight_versions
from pipeblocks.schedules import get
from pipeblocks.schedules.asynchronous import async_1f1b
from pipeblocks.core.lowering.async_mode import AsyncMode, weight_memory

from _output import write_json


def measure(p: int, n: int, steps: int, costs) -> dict:
    sync = simulate(get("1f1b")(p=p, m=n), costs)
    program = async_1f1b(p=p, n=n, steps=steps)
    steady = steady_state(simulate_program(program, costs))
    versions = weight_versions(program)
    return {
        "p": p, "n": n, "steps": steps,
        "sync_bubble": sync.bubble_ratio, "async_bubble": steady.bubble,
        "sync_throughput": n / sync.makespan, "async_throughput": steady.throughput,
        "speedup": steady.throughput * sync.makespan / n,
        "max_delay": [versions.max_delay(s) for s in range(p)],
        "weights_pipedream": list(weight_memory(program, AsyncMode("pipedream"))),
        "weights_pipemare": list(weight_memory(program, AsyncMode("pipemare"))),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps simulated, 3 or more (default: 4 + 2p/N, past the warm-up)")
    parser.add_argument("--costs", default="1,1,1", help="TF,TB,TW[,TCOMM]")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON ('-' for stdout)")
    args = parser.parse_args(argv)
    costs = parse_costs(args.costs)
    rows = [measure(p, n, args.steps or 4 + 2 * p // n, costs) for p in args.p for n in args.n]
    print(f"{'p':>3} {'N':>3} {'sync bubble':>11} {'async bubble':>12} {'speed-up':>8}  "
          f"{'delays (stage 0..p-1)':<24} {'weights pipedream':<24} weights pipemare")
    for r in rows:
        print(f"{r['p']:>3} {r['n']:>3} {r['sync_bubble']:>11.4f} {r['async_bubble']:>12.4f} {r['speedup']:>8.3f}  "
              f"{' '.join(map(str, r['max_delay'])):<24} {' '.join(f'{w:g}' for w in r['weights_pipedream']):<24} "
              f"{' '.join(f'{w:g}' for w in r['weights_pipemare'])}")
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
