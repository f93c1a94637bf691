"""Simulator speed: generate, validate, lower and simulate large schedules.

    python benchmarks/simulator_speed.py [--json FILE]

Prints one row per case: actions, seconds for generation (one run) and for simulate()
(structure check + lowering + event simulation, best of 3 runs).
"""
from __future__ import annotations

import argparse
import json
import time

from pipeblocks import schedules, simulate

CASES = [
    ("1f1b", 64, 512, {}),
    ("interleaved-1f1b", 64, 512, {"v": 2}),
    ("bfs", 64, 512, {"v": 2}),
    ("zb-h1", 64, 512, {}),
    ("zb-v", 64, 512, {}),
    ("v-half", 64, 512, {}),
]


def best_of(n: int, fn) -> tuple[float, object]:
    best, value = float("inf"), None
    for _ in range(n):
        start = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - start)
    return best, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = parser.parse_args()
    rows = []
    print(f"{'schedule':<18} {'p':>3} {'m':>4} {'actions':>8} {'generate s':>10} {'simulate s':>10}")
    for name, p, m, options in CASES:
        if name not in schedules.names():
            continue
        gen_s, schedule = best_of(1, lambda: schedules.get(name)(p=p, m=m, **options))
        sim_s, timeline = best_of(3, lambda: simulate(schedule))
        actions = sum(len(a) for a in schedule.ranks)
        rows.append({"schedule": name, "p": p, "m": m, "actions": actions, "generate_s": gen_s, "simulate_s": sim_s,
                     "bubble_ratio": timeline.bubble_ratio})
        print(f"{name:<18} {p:>3} {m:>4} {actions:>8} {gen_s:>10.3f} {sim_s:>10.3f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
