"""pipeblocks' runtime against torch.distributed.pipelining: same model, schedule and microbatches.

    PYTHONPATH=src python benchmarks/runtime_vs_torch.py                  # p=4, m=8 and m=16 (a few minutes)
    PYTHONPATH=src python benchmarks/runtime_vs_torch.py --quick          # p=4, m=8, fewer steps
    PYTHONPATH=src python benchmarks/runtime_vs_torch.py --configs 4x8,2x8 --json out.json
    PYTHONPATH=src python benchmarks/runtime_vs_torch.py --configs 4x8 --schedules dualpipev,zb-v --modes emulated
    PYTHONPATH=src python benchmarks/runtime_vs_torch.py --configs 2x8 --schedules dualpipev,zb-v --modes real

For each schedule both libraries have (GPipe, 1F1B, Interleaved 1F1B, ZB-V, DualPipeV), each (p, m)
and each mode, the same GPT (2p transformer blocks, the stage split of
`pipeblocks.models.build_stages`, weights from one seed) trains on the same microbatches on p
local gloo processes, first under pipeblocks' `PipelineRunner`, then under torch's own
schedule class (`ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`,
`ScheduleZBVZeroBubble`, `ScheduleDualPipeV`) over `PipelineStage`s of the same stage modules. Global stage
indices and placements coincide (loop: stage s on rank s mod p; V: stages i and 2p-1-i on
rank i), so each rank holds the same stages in both runs.

Modes:

* emulated: every pass sleeps its modelled cost (`--f/--b/--w` ms per transformer block
  and microbatch) while tensors of the real shapes and dtypes cross gloo. pipeblocks runs
  `EmulatedCompute`. Torch runs `SleepStage` modules (below) through its real code path
  (autograd, its B/W split): the forward sleeps F, and the backward is two custom autograd
  nodes, one on the input path that sleeps B and one on the weight path that sleeps W.
  Torch's I (input-gradient) pass reaches only the input-path node and its W pass only the
  weight-path node, so B and W time land where torch's split puts them; a fused backward
  (GPipe, 1F1B) runs both. One asymmetry is torch's own: its stage 0 skips I and does the
  whole backward in W (a known limit of torch.distributed.pipelining's runtime), so there stage 0 sleeps B + W at W, which is
  what torch does with real modules too. This is the fair test of runtime overhead.
* real: the real GPT stage modules and cross-entropy loss on both sides. The step losses
  of the two runs are compared (same weights and data, so they must agree). With p
  processes on a machine with fewer cores, real-compute timings are CPU-contended and
  indicative only; every rank runs `torch.set_num_threads(1)`.

Iteration time: a barrier, then every rank runs one step; the step's time is the latest
end minus the earliest start over the ranks (one machine shares `perf_counter`); the
figure is the median over `--steps` steps after `--warmup` steps. pipeblocks' bubble: three
more steps record the measured Timeline; the median of their `bubble_ratio` is compared
with the simulator's for the same schedule and costs (emulated mode); "excess" is the
difference in percentage points. The simulator's comparison point has free communication;
"vs sim+lat" compares with a simulation whose every transfer takes the measured hand-over
latency t_comm (median delay from a pass's end to the waiting consumer's start on another
rank, `pipeblocks.sim.overhead`): what is left there is the runtime's own overhead and the
machine's, split into "overrun" (passes longer than their sleep) and "between" (time
between passes). The JSON also holds the transport alone, a one-way gloo latency of one
activation measured at start-up (ping-pong between ranks 0 and 1). Targets: at most 1 point
over sim+lat (emulated) and pipeblocks/torch <= 1.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from pipeblocks import schedules
from pipeblocks.core.ir.schedule import Schedule
from pipeblocks.models import GPTConfig, build_stages, cross_entropy, layer_counts
from pipeblocks.runtime import PipelineRunner, spawn
from pipeblocks.runtime.emulate import EmulatedCompute, EmulatedCosts, precise_sleep
from pipeblocks.sim import simulate
from pipeblocks.sim.overhead import overhead_breakdown

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-v", "dualpipev")
MODES = ("emulated", "real")
RECORDED_STEPS = 3  # pipeblocks steps that record a Timeline; the bubble is their median


@dataclass(frozen=True)
class Plan:
    """Everything one spawn of p processes runs."""

    p: int
    m: int
    names: tuple[str, ...]
    modes: tuple[str, ...]
    f_ms: float
    b_ms: float
    w_ms: float
    hidden: int
    seq: int
    micro_batch: int
    steps: int
    warmup: int

    def config(self) -> GPTConfig:
        return GPTConfig(layers=2 * self.p, hidden=self.hidden, heads=4, seq=self.seq, vocab=256)


# ---- torch side: emulated stage modules -------------------------------------------------

def _sleep(seconds: float, tensor: torch.Tensor) -> None:
    if tensor.device.type != "meta":  # torch may trace a stage on meta once
        precise_sleep(seconds)  # the sleep EmulatedCompute uses, so both sides sleep alike


class _InputPathSleep(torch.autograd.Function):
    """Identity on the input path: forward sleeps F, backward sleeps B."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, f_s: float, b_s: float) -> torch.Tensor:
        _sleep(f_s, x)
        ctx.b_s = b_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _sleep(ctx.b_s, grad)
        return grad, None, None


class _WeightPathSleep(torch.autograd.Function):
    """Identity on the weight path: backward sleeps W."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, w_s: float) -> torch.Tensor:
        ctx.w_s = w_s
        return w.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _sleep(ctx.w_s, grad)
        return grad, None


class SleepStage(nn.Module):
    """A stage that sleeps its modelled cost and maps the real input shape to the real output
    shape with a cheap op: token ids [b, s] -> hidden [b, s, h] on stage 0, hidden -> hidden
    in the middle, hidden -> logits [b, s, vocab] on the last stage."""

    def __init__(self, cfg: GPTConfig, *, index: int, num_stages: int, layers: int, costs: EmulatedCosts) -> None:
        super().__init__()
        self.cfg, self.index, self.last = cfg, index, index == num_stages - 1
        self.f_s, self.b_s, self.w_s = (ms * layers / 1000.0 for ms in (costs.f_ms, costs.b_ms, costs.w_ms))
        self.weight = nn.Parameter(torch.zeros((), dtype=cfg.torch_dtype))
        self.embed = nn.Parameter(torch.zeros(cfg.hidden, dtype=cfg.torch_dtype)) if index == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed.expand(*x.shape, self.cfg.hidden)
        if self.last:
            x = x.mean(-1, keepdim=True).expand(*x.shape[:-1], self.cfg.vocab)
        return _InputPathSleep.apply(x, self.f_s, self.b_s) + _WeightPathSleep.apply(self.weight, self.w_s)


# ---- one process ------------------------------------------------------------------------

def _batch(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (plan.m * plan.micro_batch, plan.seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _stage_modules(plan: Plan, schedule: Schedule, rank: int, mode: str) -> dict[int, nn.Module]:
    cfg, S = plan.config(), schedule.num_stages
    mine = schedule.placement.stages_of(rank)
    if mode == "real":
        return dict(zip(mine, build_stages(cfg, seed=0, num_stages=S, stages=mine)))
    counts = layer_counts(cfg.layers, S)
    costs = _costs(plan, schedule)
    return {s: SleepStage(cfg, index=s, num_stages=S, layers=counts[s], costs=costs) for s in mine}


def _costs(plan: Plan, schedule: Schedule) -> EmulatedCosts:
    return EmulatedCosts(plan.f_ms, plan.b_ms, plan.w_ms,
                         layers=layer_counts(plan.config().layers, schedule.num_stages))


def _timed_steps(step: Callable[[], object], zero: Callable[[], None], plan: Plan) -> tuple[list, list]:
    """(start, end) per measured step on this rank, after the warm-up steps; and the step results."""
    spans, results = [], []
    for i in range(plan.warmup + plan.steps):
        zero()
        dist.barrier()
        start = time.perf_counter()
        results.append(step())
        end = time.perf_counter()
        if i >= plan.warmup:
            spans.append((start, end))
    return spans, results


def _zero(modules: dict[int, nn.Module]) -> Callable[[], None]:
    def run() -> None:
        for module in modules.values():
            module.zero_grad(set_to_none=True)
    return run


def _run_pipeblocks(plan: Plan, name: str, mode: str, rank: int, x, y) -> dict:
    schedule = schedules.get(name)(p=plan.p, m=plan.m)
    if mode == "real":
        modules = _stage_modules(plan, schedule, rank, "real")
        compute = None
    else:
        # EmulatedCompute needs the real stage modules only to infer output shapes
        modules = _stage_modules(plan, schedule, rank, "real")
        compute = EmulatedCompute(_costs(plan, schedule), modules, schedule.num_stages)
    # torch measures no memory: time ours without the saved-tensor hooks either
    runner = PipelineRunner(schedule, modules, cross_entropy, compute=compute, timeout_s=300, measure_memory=False)
    spans, results = _timed_steps(lambda: runner.step(x, y), _zero(modules), plan)
    runner.record_timeline = True  # only now: gathering the Timeline is a collective per step
    timelines = []
    for _ in range(RECORDED_STEPS):
        _zero(modules)()
        dist.barrier()
        timelines.append(runner.step(x, y).timeline)
    out = {"spans": spans, "loss": results[0].loss if mode == "real" else None}
    if timelines[0] is not None:
        out["bubble"] = statistics.median(t.bubble_ratio for t in timelines)
        out["makespan_s"] = statistics.median(t.makespan for t in timelines)
        out["timeline"] = sorted(timelines, key=lambda t: t.bubble_ratio)[len(timelines) // 2]
    return out


def _p2p_latency_ms(plan: Plan, rank: int) -> float:
    """Median one-way gloo latency of one activation between ranks 0 and 1 (ping-pong / 2)."""
    cfg = plan.config()
    buffer = torch.zeros(plan.micro_batch, plan.seq, cfg.hidden, dtype=cfg.torch_dtype)
    rounds = []
    for _ in range(50):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        elif rank == 1:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
        rounds.append(time.perf_counter() - start)
    return statistics.median(rounds) / 2 * 1000.0


def _run_torch(plan: Plan, name: str, mode: str, rank: int, x, y) -> dict:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble,
    )

    schedule = schedules.get(name)(p=plan.p, m=plan.m)  # for the stage split and placement only
    modules = _stage_modules(plan, schedule, rank, mode)
    S = schedule.num_stages
    stages = [PipelineStage(modules[s], s, S, torch.device("cpu")) for s in sorted(modules)]
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    multi = {"interleaved-1f1b": ScheduleInterleaved1F1B, "zb-v": ScheduleZBVZeroBubble,
             "dualpipev": ScheduleDualPipeV}
    if name in single:
        runtime = single[name](stages[0], plan.m, loss_fn=cross_entropy)
    else:
        runtime = multi[name](stages, plan.m, loss_fn=cross_entropy)
    first, last = 0 in modules, S - 1 in modules

    def step() -> float | None:
        losses: list = []
        args = (x,) if first else ()
        runtime.step(*args, target=y if last else None, losses=losses if last else None, return_outputs=False)
        return float(sum(float(v.detach()) for v in losses) / plan.m) if last and mode == "real" else None

    spans, results = _timed_steps(step, _zero(modules), plan)
    return {"spans": spans, "loss": results[0]}


def _worker(ctx, plan: Plan) -> dict:
    x, y = _batch(plan)
    out: dict = {"latency_ms": _p2p_latency_ms(plan, ctx.rank)}
    for mode in plan.modes:
        for name in plan.names:
            out[(name, mode, "pipeblocks")] = _run_pipeblocks(plan, name, mode, ctx.rank, x, y)
            out[(name, mode, "torch")] = _run_torch(plan, name, mode, ctx.rank, x, y)
    return out


# ---- the parent: launch, reduce, print --------------------------------------------------

def _iteration_s(per_rank: list[dict]) -> float:
    steps = len(per_rank[0]["spans"])
    times = [max(r["spans"][i][1] for r in per_rank) - min(r["spans"][i][0] for r in per_rank) for i in range(steps)]
    return statistics.median(times)


def _loss(per_rank: list[dict]) -> float | None:
    return next((r["loss"] for r in per_rank if r["loss"] is not None), None)


def run_config(plan: Plan) -> list[dict]:
    results = spawn(_worker, plan.p, args=(plan,), timeout_s=1800, threads_per_rank=1)
    rows = []
    for mode in plan.modes:
        for name in plan.names:
            ours = [r[(name, mode, "pipeblocks")] for r in results]
            theirs = [r[(name, mode, "torch")] for r in results]
            schedule = schedules.get(name)(p=plan.p, m=plan.m)
            sim = simulate(schedule, _costs(plan, schedule).sim_costs(schedule))
            row = {
                "schedule": name, "mode": mode, "p": plan.p, "m": plan.m,
                "pipeblocks_s": _iteration_s(ours), "torch_s": _iteration_s(theirs),
                "bubble_measured": ours[0]["bubble"], "makespan_measured_s": ours[0]["makespan_s"],
                "loss_pipeblocks": _loss(ours), "loss_torch": _loss(theirs),
            }
            row["ratio"] = row["pipeblocks_s"] / row["torch_s"]
            if mode == "emulated":
                row["bubble_simulated"] = sim.bubble_ratio
                row["makespan_simulated_s"] = sim.makespan / 1000.0
                row["excess_pp"] = 100.0 * (row["bubble_measured"] - sim.bubble_ratio)
                row["p2p_latency_ms"] = results[0]["latency_ms"]
                # the median step's excess split into hand-over latency, pass overruns, the rest
                split = overhead_breakdown(ours[0]["timeline"], _costs(plan, schedule).sim_costs(schedule), unit_s=1e-3)
                row["breakdown"] = split.as_dict()
                row["handover_latency_ms"] = split.latency_s * 1e3
                row["bubble_simulated_with_latency"] = split.bubble_latency
                row["excess_over_latency_pp"] = 100.0 * (row["bubble_measured"] - split.bubble_latency)
            rows.append(row)
    return rows


def _print_table(rows: list[dict], plan_text: str) -> None:
    print(plan_text)
    head = (f"{'schedule':17s} {'mode':8s} {'p':>2s} {'m':>3s} {'pipeblocks s/it':>15s} {'torch s/it':>10s} "
            f"{'ratio':>6s} {'bubble meas':>11s} {'bubble sim':>10s} {'excess pp':>9s} {'vs sim+lat':>10s} "
            f"{'t_comm ms':>9s} {'overrun':>7s} {'between':>7s}")
    print(head)
    print("-" * len(head))
    for r in rows:
        sim = f"{r['bubble_simulated']:10.3f}" if "bubble_simulated" in r else f"{'-':>10s}"
        excess = f"{r['excess_pp']:+9.2f}" if "excess_pp" in r else f"{'-':>9s}"
        excess += f" {r['excess_over_latency_pp']:+10.2f}" if "excess_pp" in r else f" {'-':>10s}"
        if "breakdown" in r:
            split = r["breakdown"]
            excess += f" {r['handover_latency_ms']:9.3f} {split['overrun_pp']:+7.2f} {split['between_pp']:+7.2f}"
        print(f"{r['schedule']:17s} {r['mode']:8s} {r['p']:2d} {r['m']:3d} {r['pipeblocks_s']:15.3f} "
              f"{r['torch_s']:10.3f} {r['ratio']:6.3f} {r['bubble_measured']:11.3f} {sim} {excess}")


def _targets(rows: list[dict]) -> dict:
    emulated = [r for r in rows if r["mode"] == "emulated"]
    return {
        "max_excess_pp_emulated": max((r["excess_pp"] for r in emulated), default=None),
        "excess_within_2pp": all(r["excess_pp"] <= 2.0 for r in emulated),
        "max_excess_over_latency_pp": max((r["excess_over_latency_pp"] for r in emulated), default=None),
        "excess_over_latency_within_1pp": all(r["excess_over_latency_pp"] <= 1.0 for r in emulated),
        "max_ratio_emulated": max((r["ratio"] for r in emulated), default=None),
        "at_least_as_fast_emulated": all(r["ratio"] <= 1.0 for r in emulated),
        "max_ratio_real": max((r["ratio"] for r in rows if r["mode"] == "real"), default=None),
    }


def _parse_configs(text: str) -> list[tuple[int, int]]:
    configs = []
    for item in text.split(","):
        try:
            p, m = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--configs: {item!r} is not PxM (e.g. 4x8)") from None
        if p < 2 or m < p:
            raise SystemExit(f"--configs: {item!r} needs p >= 2 and m >= p (1F1B and ZB-V need m >= p)")
        configs.append((p, m))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=None, help="comma-separated PxM (default 4x8,4x16; --quick: 4x8)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"subset of {','.join(SCHEDULES)}")
    parser.add_argument("--modes", default=",".join(MODES), help="emulated,real")
    parser.add_argument("--f", type=float, default=20.0, help="emulated forward ms per block and microbatch")
    parser.add_argument("--b", type=float, default=20.0, help="emulated input-gradient ms per block")
    parser.add_argument("--w", type=float, default=20.0, help="emulated weight-gradient ms per block")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 5; --quick: 3)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="p=4, m=8 only, 3 measured steps")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows and targets as JSON")
    args = parser.parse_args()
    names = tuple(args.schedules.split(","))
    modes = tuple(args.modes.split(","))
    for name in names:
        if name not in SCHEDULES:
            raise SystemExit(f"--schedules: {name!r} is not one both libraries have; choose from {SCHEDULES}")
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"--modes: {mode!r} is not one of {MODES}")
    configs = _parse_configs(args.configs or ("4x8" if args.quick else "4x8,4x16"))
    for p, m in configs:
        if "dualpipev" in names and m < 2 * p:
            raise SystemExit(f"--configs: dualpipev needs m >= 2p; {p}x{m} takes m >= {2 * p} (use {p}x{2 * p})")
    steps = args.steps if args.steps is not None else (3 if args.quick else 5)
    rows: list[dict] = []
    plans = []
    for p, m in configs:
        plan = Plan(p, m, names, modes, args.f, args.b, args.w, args.hidden, args.seq, args.micro_batch, steps,
                    args.warmup)
        plans.append(plan)
        rows.extend(run_config(plan))
    cfg = plans[0].config()
    _print_table(rows, (
        f"emulated: F/B/W = {args.f:g}/{args.b:g}/{args.w:g} ms per block and microbatch, 2p blocks; "
        f"real: GPT hidden={cfg.hidden} seq={cfg.seq} vocab={cfg.vocab} float32, {args.micro_batch} sequences per "
        f"microbatch, 2p blocks\nmedian of {steps} steps after {args.warmup} warm-up; gloo, 1 thread per rank. "
        "Real-compute timings are CPU-contended when p exceeds the cores: indicative only."
    ))
    targets = _targets(rows)
    parts = []
    if targets["max_excess_pp_emulated"] is not None:
        parts.append(f"emulated bubble excess max {targets['max_excess_pp_emulated']:+.2f} pp "
                     f"(<= 2: {targets['excess_within_2pp']}), over sim+lat max "
                     f"{targets['max_excess_over_latency_pp']:+.2f} pp (<= 1: {targets['excess_over_latency_within_1pp']})")
    if targets["max_ratio_emulated"] is not None:
        parts.append(f"pipeblocks/torch max {targets['max_ratio_emulated']:.3f} emulated "
                     f"(<= 1: {targets['at_least_as_fast_emulated']})")
    if targets["max_ratio_real"] is not None:
        parts.append(f"pipeblocks/torch max {targets['max_ratio_real']:.3f} real")
    print("targets: " + "; ".join(parts))
    for r in rows:
        if r["mode"] == "real" and r["loss_pipeblocks"] is not None and r["loss_torch"] is not None:
            if abs(r["loss_pipeblocks"] - r["loss_torch"]) > 1e-4 * max(1.0, abs(r["loss_torch"])):
                print(f"warning: {r['schedule']} p={r['p']} m={r['m']}: step losses differ, pipeblocks "
                      f"{r['loss_pipeblocks']:.6f} vs torch {r['loss_torch']:.6f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"plans": [asdict(p) for p in plans], "rows": rows, "targets": targets,
                       "threads_per_rank": 1, "torch": torch.__version__}, handle, indent=2)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
