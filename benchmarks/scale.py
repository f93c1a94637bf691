"""Scale: whole-process time and peak memory of `pipeblocks simulate` at large p and m,
against the targets.

    PYTHONPATH=src python benchmarks/scale.py [--quick] [--only NAME ...] [--repeat N] [--timeout 600] [--json out.json]

Each case runs `python -m pipeblocks.cli.main simulate NAME -p P -m M` (generation,
validation, lowering, simulation) in a fresh process and reports its wall and CPU
seconds and peak RSS. On a shared machine compare CPU seconds; wall time includes waiting
for a core. A case named "NAME show" runs `show NAME -p P -m M` instead, which also
renders the text timeline. v-adaptive's "curve" case builds every budget k/2, k = 1..2p,
in one process. `--quick` runs each case at a quarter of the microbatches and half the
ranks; `--repeat N` runs each case N times and reports the fastest run (a busy machine
only ever slows a run down).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# (name, p, m, extra CLI arguments, target seconds, target GB)
TARGETS = [
    ("zb-v", 128, 1024, [], 10, None),
    ("v-half", 128, 1024, [], 10, None),
    ("v-half show", 128, 1024, [], 10, None),
    ("v-zb", 64, 512, [], 5, None),
    ("zb", 64, 512, [], 30, None),
    ("v-adaptive", 8, 32, [], 1, None),
    ("v-adaptive curve", 8, 32, [], 5, None),
    ("v-adaptive", 16, 64, [], 5, None),
    ("1f1b", 512, 4096, [], 10, 2.0),
]

_CHILD = """
import resource, runpy, sys
sys.argv = ["pipeblocks"] + sys.argv[1:]
try:
    runpy.run_module("pipeblocks.cli.main", run_name="__main__")
finally:
    use = resource.getrusage(resource.RUSAGE_SELF)
    print(f"@@scale {use.ru_utime + use.ru_stime} {use.ru_maxrss}", file=sys.stderr)
"""

_CURVE = """
import resource, sys
from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.schedules import get
from pipeblocks.sim import simulate
p, m = int(sys.argv[1]), int(sys.argv[2])
for k in range(1, 2 * p + 1):
    try:
        simulate(get("v-adaptive")(p=p, m=m, memory_limit=k / 2))
    except ScheduleError:
        pass
use = resource.getrusage(resource.RUSAGE_SELF)
print(f"@@scale {use.ru_utime + use.ru_stime} {use.ru_maxrss}", file=sys.stderr)
"""


def run_case(name: str, p: int, m: int, extra: list[str], timeout: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if name == "v-adaptive curve":
        command = [sys.executable, "-c", _CURVE, str(p), str(m)]
    elif name.endswith(" show"):
        command = [sys.executable, "-c", _CHILD, "show", name.split()[0], "-p", str(p), "-m", str(m), *extra]
    else:
        command = [sys.executable, "-c", _CHILD, "simulate", name, "-p", str(p), "-m", str(m), "--json", *extra]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"wall_s": None, "cpu_s": None, "peak_rss_gb": None, "status": f"timeout {timeout:g} s"}
    wall = time.perf_counter() - started
    marks = [line.split() for line in done.stderr.splitlines() if line.startswith("@@scale")]
    if done.returncode != 0 or not marks:
        return {"wall_s": wall, "cpu_s": None, "peak_rss_gb": None, "status": f"failed: {done.stderr.strip()[-200:]}"}
    cpu, rss_kb = float(marks[-1][1]), float(marks[-1][2])
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_gb": rss_kb / 2**20, "status": "ok"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="half the ranks, a quarter of the microbatches")
    parser.add_argument("--only", nargs="+", default=None, help="run only these case names")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the fastest is reported (default 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case (default 600)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'case':17} {'p':>4} {'m':>5} {'wall s':>8} {'cpu s':>8} {'target s':>8} {'peak GB':>8} {'target GB':>9}  status")
    for name, p, m, extra, target_s, target_gb in TARGETS:
        if args.only and name not in args.only:
            continue
        if args.quick:
            p, m = max(2, p // 2), max(p // 2, m // 4)
        runs = [run_case(name, p, m, extra, args.timeout) for _ in range(max(1, args.repeat))]
        timed = [run for run in runs if run["wall_s"] is not None and run["status"] == "ok"]
        r = {"case": name, "p": p, "m": m, "target_s": target_s, "target_gb": target_gb,
             **(min(timed, key=lambda run: run["wall_s"]) if timed else runs[-1]), "runs": len(runs)}
        rows.append(r)

        def fmt(x, spec):
            return "-" if x is None else format(x, spec)

        print(f"{name:17} {p:4d} {m:5d} {fmt(r['wall_s'], '8.2f')} {fmt(r['cpu_s'], '8.2f')} {target_s:8g} "
              f"{fmt(r['peak_rss_gb'], '8.2f')} {fmt(target_gb, '9g')}  {r['status']}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
