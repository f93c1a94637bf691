"""Balancing the stages of a large-vocabulary model: the naive split, today's rule, the
pass-time balanced split, --split auto, and --vocab-parallel.

    PYTHONPATH=src python benchmarks/vocab_balance.py                         # p = 4 and 8, 1f1b, llama-3-8b, a100
    PYTHONPATH=src python benchmarks/vocab_balance.py --p 8 --no-emulate      # the simulator only (seconds)
    PYTHONPATH=src python benchmarks/vocab_balance.py --json vocab_balance.json --vocab-parallel

The model is the `llama-3-8b` preset (32 layers, hidden 4096, a 128,256-token vocabulary,
sequences of 4096 tokens, flash attention) on the `a100` profile, trained with 1F1B
(`--schedule`) at m = 4p microbatches. Its last stage holds the head (2*s*h*V FLOPs in each
pass, about two layers' worth) and its softmax cross entropy; the first holds the embedding.
Columns:

    naive     equal layer counts, the vocabulary layers on the end stages as they come
              (the extra layers of an uneven split on the first stages)
    today     the default rule (`core.cost.split.layer_counts`): equal counts, the extra layers
              off the end stages; with 32 layers at p = 4 or 8 it is the naive split
    balanced  the split that balances the stages' F + B + W, the head included
              (`resolve.split_auto.balanced_counts`: what `plan --split auto` uses)
    auto      `--split auto`: the simulator's choice, the shortest step within --gpu-memory
    vocab     `--vocab-parallel` (embedding and head split by vocabulary over all ranks),
              only with --vocab-parallel: the stages without embedding and head, every
              rank running the IF, S, T and IB passes of every microbatch

For each: the layers per stage, the simulated step (a100), each rank's compute per step and
its memory (static at the step's peak + peak activation, GB), and the step measured on the
runtime in emulated compute: p processes on gloo, every pass sleeping its analytic time
times --scale while tensors of a small model's shapes cross between the ranks (the
runtime's emulated mode, `runtime.emulate.EmulatedCosts.from_costs`). The measured step is
given in the model's seconds (divided by the scale). For the vocab column the toy stages are
blocks without embedding and head (the last ends at its norm's X), and the vocabulary passes
sleep their analytic times (t_if, t_s, t_t, t_ib) times --scale before running on toy tables
(32 rows of the toy width) whose X, embedding gradient and all-reduces really cross gloo
(`runtime.vocab_emulate`); as for the stages' transfers, the collectives' modelled times are
not slept.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.core.cost.split import split_text
from pipeblocks.resolve.build import build, stage_model_config
from pipeblocks.resolve.split_auto import balanced_counts

MODEL = "llama-3-8b"
HARDWARE = "a100"
VARIANTS = ("naive", "today", "balanced", "auto")


def naive_counts(layers: int, stages: int) -> tuple[int, ...]:
    """Equal counts; an uneven split's extra layers on the first stages (no lightening of the ends)."""
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if s < extra else 0) for s in range(stages))


def _base(args: argparse.Namespace, p: int) -> ScheduleRequest:
    costs = CostSpec(model=MODEL, hardware=HARDWARE, flash_attention=True)
    return ScheduleRequest(name=args.schedule, m=args.m_per_rank * p, mesh=Mesh(pp=p), costs=costs,
                           gpu_memory=args.gpu_memory)


def vocab_parallel_request(base: ScheduleRequest) -> ScheduleRequest:
    """`base` with --vocab-parallel (the even split)."""
    return dataclasses.replace(base, costs=dataclasses.replace(base.costs, vocab_parallel=True))


def _request(args: argparse.Namespace, p: int, variant: str) -> ScheduleRequest:
    base = _base(args, p)
    if variant == "vocab":
        return vocab_parallel_request(base)
    even = build(base)
    stages = even.schedule.num_stages
    layers = stage_model_config(base.costs, stages).layers
    if variant == "today":
        return base
    if variant == "naive":
        counts = naive_counts(layers, stages)
    elif variant == "auto":
        counts = "auto"
    else:  # balanced: each stage's F + B + W as a fixed part (the head's) plus its layers
        totals = [f + b + w for f, b, w in zip(even.costs.t_f, even.costs.t_b, even.costs.t_w)]
        current = stage_model_config(base.costs, stages).stage_layers(stages)
        per_layer = totals[0] / current[0]
        counts = balanced_counts(layers, per_layer, [t - n * per_layer for t, n in zip(totals, current)])
    return dataclasses.replace(base, costs=dataclasses.replace(base.costs, split=counts))


def simulated(args: argparse.Namespace, p: int, variant: str) -> tuple[dict, object]:
    """The variant's figures from the simulator, and its Built (schedule and costs) for the emulated run."""
    built = build(_request(args, p, variant))
    timeline = built.simulate()
    stages = built.schedule.num_stages
    counts = stage_model_config(built.request.costs, stages, p=p).stage_layers(stages)
    need = list(timeline.memory_need)
    row = {
        "variant": variant, "p": p, "m": built.schedule.m, "schedule": built.schedule.name, "split": list(counts),
        "step_simulated_s": timeline.makespan, "bubble_simulated": timeline.bubble_ratio,
        "busy_s": [timeline.busy(r) for r in range(p)], "memory_gb": [x / 1e9 for x in need],
        "memory_spread": max(need) / min(need) - 1.0, "fits": args.gpu_memory is None or max(need) <= args.gpu_memory * 1e9,
    }
    return row, built


# ---- the emulated runtime ------------------------------------------------------------------

def _worker(ctx, cases, warmup, steps):
    import torch

    from pipeblocks.core.ir.vocab import roots
    from pipeblocks.models.toy import ToyConfig, cross_entropy, toy_batch, toy_stages
    from pipeblocks.runtime import PipelineRunner
    from pipeblocks.runtime.emulate import EmulatedCompute
    from pipeblocks.runtime.vocab_emulate import toy_vocab_step
    from pipeblocks.runtime.vocab_link import DistVocabLink

    torch.set_num_threads(1)
    config = ToyConfig(vocab=32, hidden=64, seq=16)
    out = []
    for schedule, costs, vocab_times, vocab_costs in cases:
        S = schedule.num_stages
        vocab = vocab_times is not None
        stages = toy_stages(S, config, dtype=torch.float32, with_vocab=not vocab)
        mine = {s: stages[s] for s in schedule.placement.stages_of(ctx.rank)}
        link, extra = None, {}
        if vocab:  # every process makes the link's groups (collective), then its rows of toy tables
            first, last = roots(schedule)
            link = DistVocabLink(list(range(schedule.p)), (config.seq, config.hidden), torch.float32,
                                 first=first, last=last)
            extra = {"vocab": toy_vocab_step(ctx.rank, link, ranks=schedule.p, vocab=config.vocab,
                                             hidden=config.hidden, first=first, last=last, before_pass=vocab_times),
                     "vocab_costs": vocab_costs}
        runner = PipelineRunner(schedule, mine, cross_entropy, timeout_s=600,
                                compute=EmulatedCompute(costs, mine, S, vocab_parallel=vocab), measure_memory=False,
                                **extra)
        x, y = toy_batch(schedule.m, config)
        for _ in range(warmup):
            runner.step(x, y)
        runner.record_timeline = True
        timelines = [runner.step(x, y).timeline for _ in range(steps)]  # the whole step's, on rank 0
        latency = None
        if link is not None:
            link.close()
            latency = _all_reduce_ms(link.groups["C0"], (config.seq, config.hidden))
        out.append(([t.makespan for t in timelines if t is not None], latency))
    return out


def _all_reduce_ms(group, shape, repeats: int = 20) -> float:
    """Median wall milliseconds of one all-reduce of a toy tensor of `shape` over `group` (every
    rank calls it): what each of C0's two all-reduces and IF's one costs on this machine."""
    import torch
    import torch.distributed as dist

    tensor = torch.zeros(shape)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(builts: list, p: int, scale: float, warmup: int, steps: int) -> list[tuple[list[float], float | None]]:
    """Emulated step times (seconds of the model: measured / scale) of each Built, in one set of p
    processes; a Built whose costs price vocabulary passes runs them (`runtime.vocab_emulate`),
    and then also gives the wall milliseconds of one of its all-reduces here (else None)."""
    from pipeblocks.runtime import spawn
    from pipeblocks.runtime.emulate import EmulatedCosts
    from pipeblocks.runtime.vocab_emulate import VocabPassTimes

    cases = []
    for b in builts:
        times = None if b.costs.vocab is None else VocabPassTimes.from_costs(b.costs.vocab, ms_per_unit=1e3 * scale)
        cases.append((b.schedule, EmulatedCosts.from_costs(b.costs, b.schedule, scale=scale), times,
                      b.costs if times is not None else None))
    per_rank = spawn(_worker, p, args=(cases, warmup, steps), timeout_s=1800, threads_per_rank=1)
    return [([t / scale for t in times], latency) for times, latency in per_rank[0]]


# ---- output ----------------------------------------------------------------------------------

def _table(rows: list[dict]) -> str:
    lines = []
    for p in sorted({r["p"] for r in rows}):
        mine = [r for r in rows if r["p"] == p]
        naive = next((r for r in mine if r["variant"] == "naive"), None)
        lines.append(f"p={p}, m={mine[0]['m']}, {mine[0]['schedule']}, {MODEL} on {HARDWARE} (flash attention)")
        lines.append(f"  {'':9} {'layers per stage':<26} {'sim step s':>10} {'vs naive':>8} {'emulated s':>10} {'vs naive':>8} "
                     f"{'compute s per rank (min-max)':>28} {'memory GB per rank (min-max)':>28}")
        for r in mine:
            gain = f"{naive['step_simulated_s'] / r['step_simulated_s'] - 1:+.1%}" if naive else ""
            emulated = r.get("step_emulated_s")
            measured = f"{emulated:.3f}" if emulated is not None else "-"
            measured_gain = f"{naive['step_emulated_s'] / emulated - 1:+.1%}" if naive and emulated else ""
            busy, mem = r["busy_s"], r["memory_gb"]
            lines.append(f"  {r['variant']:<9} {split_text(r['split']):<26} {r['step_simulated_s']:>10.3f} {gain:>8} "
                         f"{measured:>10} {measured_gain:>8} {min(busy):>13.2f} - {max(busy):<12.2f} {min(mem):>13.1f} - {max(mem):<12.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", default="4,8", help="pipeline ranks, comma-separated (default 4,8)")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--m-per-rank", type=int, default=4, help="microbatches per step per pipeline rank (m = this x p)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GB per GPU that --split auto must fit (default 80)")
    parser.add_argument("--vocab-parallel", action="store_true", help="add the --vocab-parallel column")
    parser.add_argument("--no-emulate", action="store_true", help="the simulator only")
    parser.add_argument("--scale", type=float, default=0.2,
                        help="emulated seconds per modelled second (default 0.2: a 7 s step sleeps 1.4 s; smaller "
                        "scales charge the runtime's own time between passes, 1-7 ms on a busy 2-core machine, "
                        "more heavily)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="emulated steps timed; the median is reported")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    ranks = [int(x) for x in args.p.split(",")]
    variants = VARIANTS + (("vocab",) if args.vocab_parallel else ())
    rows = []
    load_before = os.getloadavg()[0]
    for p in ranks:
        started = time.monotonic()
        results = [simulated(args, p, v) for v in variants]
        print(f"p={p}: simulated {len(results)} variants in {time.monotonic() - started:.1f} s", file=sys.stderr)
        if not args.no_emulate:
            started = time.monotonic()
            times = measure([built for _, built in results], p, args.scale, args.warmup, args.steps)
            print(f"p={p}: emulated in {time.monotonic() - started:.0f} s", file=sys.stderr)
            for (row, built), (measured, latency) in zip(results, times):
                row["step_emulated_s"] = statistics.median(measured)
                row["step_emulated_runs_s"] = measured
                if latency is not None:
                    row["all_reduce_ms_measured"] = latency
                    row["c0_ms_modelled"] = built.costs.vocab.t_c0 * 1e3 * args.scale
        rows += [row for row, _ in results]
    load_after = os.getloadavg()[0]
    print(_table(rows))
    if not args.no_emulate:
        print(f"emulated at scale {args.scale:g}, median of {args.steps} steps after {args.warmup}; {os.cpu_count()} cores, "
              f"load average {load_before:.1f} before, {load_after:.1f} after (other work lengthens the emulated steps)")
    for r in rows:
        if r.get("all_reduce_ms_measured") is not None:
            print(f"vocab p={r['p']}: one all-reduce of the toy tensors took {r['all_reduce_ms_measured']:.2f} ms here "
                  f"(C0 is two back to back, IF's one); C0 is modelled at {r['c0_ms_modelled']:.2f} ms for both "
                  f"at scale {args.scale:g} and is not slept: the emulated step pays this machine's collectives")
    print("sim step: the simulated step; vs naive: the naive split's step over this one, minus 1 (+: faster); "
          "emulated: the runtime's step in emulated compute (median), in the model's seconds; compute: a rank's "
          "passes per step; memory: static at the step's peak + peak activation")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": MODEL, "hardware": HARDWARE, "flash_attention": True, "gpu_memory_gb": args.gpu_memory,
                       "scale": args.scale, "warmup": args.warmup, "steps": args.steps, "cores": os.cpu_count(),
                       "load_average": [load_before, load_after],
                       "rows": rows}, handle, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
