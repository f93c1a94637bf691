"""Runtime overhead with emulated compute: measured bubble against the simulation, and where the excess goes.

    PYTHONPATH=src python benchmarks/runtime_emulate.py                          # p=4, m=8, 5 ms per layer and pass
    PYTHONPATH=src python benchmarks/runtime_emulate.py --schedules 1f1b,zb-v,v-half --json out.json
    PYTHONPATH=src python benchmarks/runtime_emulate.py --f 20 --b 20 --w 20 --steps 3

Every action sleeps its modelled cost (ms per layer; the model has 2p layers cut into the
schedule's stages) while activations of a real shape cross gloo. For each schedule the
median (by bubble) of `--steps` recorded steps is compared with the simulator under the same
costs, and its excess is split (`pipeblocks.sim.overhead`):

    latency  the simulation with t_comm = the measured hand-over latency (median delay from a
             pass's end to the waiting consumer's start on another rank) minus the one without;
             "sim+lat" is that prediction, the one that includes the transport
    overrun  passes longer than modelled (the sleep's wake-up on a busy machine)
    between  time between passes that neither explains: the runtime's own work between
             passes, hand-overs slower than the median, processes not scheduled in time

The last columns are per pass: the hand-over latency (t_comm), the mean local gap (a pass's
start after the previous one's end when its input was already there), the mean overrun, and
the executor's own Python work per action in isolation (thread CPU time, one process, a
loopback mailbox and a compute that does nothing: what the runtime adds per action without
the transport). Targets: at most 1 point over sim+lat on every schedule. The machine's load
average is printed beside the figures: with p ranks on fewer cores, every figure but the
last column grows with the load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from pipeblocks import schedules
from pipeblocks.core.lowering.validate import validate
from pipeblocks.runtime import PipelineRunner, spawn
from pipeblocks.runtime.backward import WeightGradWork
from pipeblocks.runtime.compute import Unit
from pipeblocks.runtime.emulate import EmulatedCompute, EmulatedCosts
from pipeblocks.runtime.executor import RankExecutor
from pipeblocks.runtime.shapes import TensorSpec
from _toy import toy_schedules
from pipeblocks.models.toy import ToyConfig, cross_entropy, toy_batch, toy_stages
from pipeblocks.sim.overhead import overhead_breakdown

TARGET_PP = 1.0


def _per_stage(costs: EmulatedCosts, p: int, num_stages: int) -> EmulatedCosts:
    return EmulatedCosts(costs.f_ms, costs.b_ms, costs.w_ms, layers=2 * p // num_stages)


def _worker(ctx, names, p, m, costs, config, warmup, steps):
    out = {}
    for name in names:
        schedule = schedules.get(name)(p=p, m=m)
        stages = toy_stages(schedule.num_stages, config, dtype=torch.float32)
        mine = {s: stages[s] for s in schedule.placement.stages_of(ctx.rank)}
        compute = EmulatedCompute(_per_stage(costs, p, schedule.num_stages), mine, schedule.num_stages)
        # the saved-tensor hooks are off: emulated passes save nothing
        runner = PipelineRunner(schedule, mine, cross_entropy, timeout_s=300, compute=compute, measure_memory=False)
        x, y = toy_batch(2 * m, config)
        for _ in range(warmup):
            runner.step(x, y)
        runner.record_timeline = True
        out[name] = [runner.step(x, y).timeline for _ in range(steps)]
    return out


# ---- the executor alone: its Python work per action, no transport ---------------------

class _Loopback:
    """A mailbox whose receives are complete when posted (the buffer as it is) and whose sends go nowhere."""

    def __init__(self) -> None:
        self._posted: dict[tuple, torch.Tensor] = {}

    def send(self, tensor, peer, tag, label) -> None:
        pass

    def recv(self, key, buffer, peer, tag) -> None:
        self._posted[key] = buffer

    def flush(self) -> None:
        pass

    def arrived(self, key) -> bool:
        return True

    def wait(self, key, label):
        return self._posted.pop(key)

    def finish(self) -> None:
        pass


class _NoCompute:
    """Passes that return a preallocated activation at once."""

    def __init__(self, activation: torch.Tensor, last_stage: int) -> None:
        self.activation, self.last = activation, last_stage

    def forward(self, stage, x, target):
        if stage == self.last:
            return None, Unit(x, x, loss=torch.zeros(()))
        return self.activation, Unit(x, x)

    def input_grad(self, stage, unit, grad):
        unit.root = unit.inp = None
        unit.work = WeightGradWork([])
        return self.activation if stage > 0 else None

    def weight_grad(self, stage, unit) -> None:
        unit.work = None

    def full_backward(self, stage, unit, grad):
        unit.root = unit.inp = None
        return self.activation if stage > 0 else None


def executor_cpu_us(name: str, p: int, m: int, config: ToyConfig, repeats: int = 100) -> float:
    """Median thread CPU time per action of the executor's own work, the most of any rank (µs)."""
    schedule = schedules.get(name)(p=p, m=m)
    program = validate(schedule)
    activation = torch.zeros(2, config.seq, config.hidden)
    spec = TensorSpec.of(activation)
    tokens = [torch.zeros(2, config.seq, dtype=torch.long)] * m
    worst = 0.0
    for rank in range(p):
        specs, out_specs = {}, {}
        for stage in schedule.placement.stages_of(rank):
            for mb in range(m):
                specs[("F", stage - 1, mb, 0)] = specs[("B", stage + 1, mb, 0)] = out_specs[(stage, mb, 0)] = spec
        executor = RankExecutor(program, rank, _NoCompute(activation, schedule.num_stages - 1), _Loopback(),
                                torch.device("cpu"), specs, out_specs)
        for _ in range(5):
            executor.run(tokens, tokens)
        times = []
        for _ in range(repeats):
            start = time.thread_time()
            executor.run(tokens, tokens)
            times.append(time.thread_time() - start)
        worst = max(worst, statistics.median(times) / len(schedule.ranks[rank]) * 1e6)
    return worst


# ---- the parent ---------------------------------------------------------------------

def run(names, p, m, costs, config, warmup, steps) -> list[dict]:
    timelines = spawn(_worker, p, args=(names, p, m, costs, config, warmup, steps), timeout_s=1800,
                      threads_per_rank=1)[0]
    rows = []
    for name in names:
        schedule = schedules.get(name)(p=p, m=m)
        model = _per_stage(costs, p, schedule.num_stages).sim_costs(schedule)
        recorded = sorted(timelines[name], key=lambda t: t.bubble_ratio)
        median = recorded[len(recorded) // 2]
        b = overhead_breakdown(median, model, unit_s=1e-3)
        row = {"schedule": name, "p": p, "m": m, "makespan_measured_ms": median.makespan * 1e3,
               "bubble_steps": [t.bubble_ratio for t in timelines[name]],
               "executor_cpu_us_per_action": executor_cpu_us(name, p, m, config), **b.as_dict()}
        row["within_target"] = b.excess_over_latency_pp <= TARGET_PP
        rows.append(row)
    return rows


def _print(rows: list[dict], header: str) -> None:
    print(header)
    head = (f"{'schedule':17s} {'run ms':>7s} {'bubble sim':>10s} {'sim+lat':>7s} {'run':>6s} {'excess':>7s} "
            f"{'latency':>7s} {'overrun':>7s} {'between':>7s} {'over sim+lat':>12s} {'t_comm ms':>9s} "
            f"{'gap us':>6s} {'overrun us':>10s} {'py us/action':>12s}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['schedule']:17s} {r['makespan_measured_ms']:7.1f} {r['bubble_model']:10.3f} "
              f"{r['bubble_latency']:7.3f} {r['bubble_measured']:6.3f} {r['excess_pp']:+7.2f} {r['latency_pp']:+7.2f} "
              f"{r['overrun_pp']:+7.2f} {r['between_pp']:+7.2f} {r['excess_over_latency_pp']:+12.2f} "
              f"{r['latency_s'] * 1e3:9.3f} {r['local_gap_s'] * 1e6:6.0f} {r['overrun_s'] * 1e6:10.0f} "
              f"{r['executor_cpu_us_per_action']:12.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--f", type=float, default=5.0, help="forward ms per layer")
    parser.add_argument("--b", type=float, default=5.0, help="input-gradient ms per layer")
    parser.add_argument("--w", type=float, default=5.0, help="weight-gradient ms per layer")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="recorded steps; the median by bubble is analysed")
    parser.add_argument("--schedules", default="", help="comma-separated names (default: all that build)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    if args.p < 2 or args.m < 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit("need --p >= 2, --m >= 1, --steps >= 1 and --warmup >= 0")
    wanted = args.schedules.split(",") if args.schedules else schedules.names()
    unknown = [n for n in wanted if n not in schedules.names()]
    if unknown:
        raise SystemExit(f"--schedules: unknown {unknown}; `pipeblocks list` names them")
    names = toy_schedules(args.p, args.m, wanted)
    config = ToyConfig(vocab=32, hidden=args.hidden, seq=args.seq)
    costs = EmulatedCosts(args.f, args.b, args.w)
    load_before = os.getloadavg()
    rows = run(names, args.p, args.m, costs, config, args.warmup, args.steps)
    load_after = os.getloadavg()
    _print(rows, (
        f"p={args.p} m={args.m} F/B/W={args.f:g}/{args.b:g}/{args.w:g} ms per layer, 2p layers, activation "
        f"float32[2, {args.seq}, {args.hidden}] ({2 * args.seq * args.hidden * 4 // 1024} KiB); median of "
        f"{args.steps} steps after {args.warmup}; bubble columns in points; {os.cpu_count()} cores, load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after"
    ))
    worst = max(rows, key=lambda r: r["excess_over_latency_pp"])
    print(f"target: <= {TARGET_PP:g} point over sim+lat on every schedule: "
          f"{all(r['within_target'] for r in rows)} (worst {worst['schedule']} {worst['excess_over_latency_pp']:+.2f})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"p": args.p, "m": args.m, "costs_ms": [args.f, args.b, args.w], "hidden": args.hidden,
                       "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "cores": os.cpu_count(),
                       "load_average": [load_before[0], load_after[0]], "target_pp": TARGET_PP, "rows": rows,
                       "torch": torch.__version__}, handle, indent=2)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
