"""Predicted against measured: `train --dry-run --hardware PROFILE.json` beside `train` itself.

    pipeblocks calibrate -o docs/calibration/cpu.json                    # as a rank of p = 2 (--ranks' default)
    PYTHONPATH=src python benchmarks/calibration_check.py --profile docs/calibration/cpu.json
    PYTHONPATH=src python benchmarks/calibration_check.py --profile cpu.json --sizes 8x256x128x4 --repeats 1 --json out.json

For each size (LAYERSxHIDDENxSEQxMICROBATCH of the reference GPT) and schedule, with p
ranks and m microbatches: the dry run's predicted iteration time from the profile (pass
times from its fitted fractions and the FLOPs counted on the run's own stages, its link
for the hops), the dry run's prediction from pass times profiled in this process (what
`--dry-run` does without --hardware), and `pipeblocks train` run for --steps steps with
--report, whose measured iteration time (median over the steps after two warm-up steps,
first pass start to last pass end) and whole step time (with the optimizer step) are read
from the report. With --repeats, train runs that many times and the fastest is kept: a
shared machine's other work only ever slows a run down. The error is predicted / measured
- 1. The load average before each run is printed, because a busy machine is slower than
the profile says.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile

from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.models.config import GPTConfig
from pipeblocks.train.run import dry_run, prepare


def _size(text: str) -> tuple[int, int, int, int]:
    layers, hidden, seq, microbatch = (int(x) for x in text.lower().split("x"))
    return layers, hidden, seq, microbatch


def predicted(size, schedule: str, p: int, m: int, hardware: str | None) -> float:
    layers, hidden, seq, microbatch = size
    request = ScheduleRequest(name=schedule, m=m, mesh=Mesh(pp=p), costs=CostSpec(hardware=hardware or "a100"))
    model = GPTConfig(layers=layers, hidden=hidden, heads=4, seq=seq, vocab=256)
    cfg, data = prepare(request, model=model, microbatch_size=microbatch, steps=1, device="cpu")
    return dry_run(cfg, data, out=io.StringIO(), hardware=hardware)["iteration_time_predicted_s"]


def measured(size, schedule: str, p: int, m: int, steps: int) -> dict:
    layers, hidden, seq, microbatch = size
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "run.json")
        command = [sys.executable, "-m", "pipeblocks", "train", "--schedule", schedule, "-p", str(p), "-m", str(m),
                   "--layers", str(layers), "--hidden", str(hidden), "--seq", str(seq), "--microbatch-size",
                   str(microbatch), "--steps", str(steps), "--device", "cpu", "--quiet", "--report", report,
                   "--plot", os.path.join(tmp, "run.png")]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        with open(report) as handle:
            data = json.load(handle)
    return {"iteration_s": data["iteration_time_measured_s"], "step_s": data["step_time_s"],
            "simulated_from_run_s": data["iteration_time_simulated_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True, help="a profile written by `pipeblocks calibrate`")
    parser.add_argument("--sizes", default="8x256x128x4,8x512x128x2", help="LAYERSxHIDDENxSEQxMICROBATCH,...")
    parser.add_argument("--schedules", default="1f1b,zb-h1")
    parser.add_argument("-p", type=int, default=2)
    parser.add_argument("-m", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="train runs per row; the fastest is kept")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    rows = []
    print(f"{'size LxHxSxB':>14} {'schedule':>8} {'load':>5} {'profile ms':>10} {'here ms':>8} {'measured ms':>11} "
          f"{'step ms':>8} {'error':>7} {'here err':>8}")
    for text in args.sizes.split(","):
        size = _size(text)
        for schedule in args.schedules.split(","):
            from_profile = predicted(size, schedule, args.p, args.m, args.profile)
            here = predicted(size, schedule, args.p, args.m, None)
            load = os.getloadavg()[0]
            runs = [measured(size, schedule, args.p, args.m, args.steps) for _ in range(args.repeats)]
            best = min(runs, key=lambda r: r["iteration_s"])
            row = {"size": text, "schedule": schedule, "p": args.p, "m": args.m, "load_before": load,
                   "predicted_profile_s": from_profile, "predicted_here_s": here, **best,
                   "iteration_runs_s": [r["iteration_s"] for r in runs],
                   "error": from_profile / best["iteration_s"] - 1, "error_here": here / best["iteration_s"] - 1}
            rows.append(row)
            print(f"{text:>14} {schedule:>8} {load:5.1f} {from_profile * 1e3:10.1f} {here * 1e3:8.1f} "
                  f"{best['iteration_s'] * 1e3:11.1f} {best['step_s'] * 1e3:8.1f} {row['error']:+7.1%} "
                  f"{row['error_here']:+8.1%}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"profile": args.profile, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
