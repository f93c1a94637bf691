"""Seq1F1B against 1F1B in the runtime, on CPU: measured rank-0 memory and iteration time.

    python benchmarks/seq1f1b_runtime.py [-p 2] [-m 4] [--seq 1024] [--chunks 2,4] [--microbatch-size 2] [--json FILE]

A long-sequence, small GPT (float32, 2 sequences per microbatch) is trained for a few steps by
`PipelineRunner` on p local gloo processes under 1F1B and under Seq1F1B with k chunks cut
evenly (equal tokens) or balanced (equal FLOPs under causal attention). Per run: rank 0's
measured peak saved-activation bytes, the simulator's prediction for it (profiled
per-stage bytes and per-chunk shares), the ratio to 1F1B against (k+p-1)/(kp), and the
median step time after a warm-up step. CPU times show the runtime's cost of k-fold more,
smaller passes; the bubble gain of Seq1F1B needs passes long enough to hide them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the shared rank worker and profiles

import torch  # noqa: E402

from pipeblocks.models import GPTConfig, build_stages, cross_entropy  # noqa: E402
from pipeblocks.runtime import PipelineRunner, spawn  # noqa: E402

from _sequence_cases import build, lengths, predicted_peaks  # noqa: E402


def worker(ctx, runs: list[tuple[str, int, str]], model: dict, m: int, b: int, steps: int) -> dict:
    """Per run (case, k, split): this rank's peak saved bytes and its step times."""
    out = {}
    cfg = GPTConfig(**model)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (m * b, cfg.seq + 1), generator=gen)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    for case, k, how in runs:
        schedule = build(case, ctx.world_size, m, k)
        mine = build_stages(cfg, seed=0, num_stages=schedule.num_stages, stages=schedule.placement.stages_of(ctx.rank))
        runner = PipelineRunner(schedule, {s.index: s for s in mine}, cross_entropy, timeout_s=300.0,
                                seq_lengths=lengths(cfg, k, how) if k > 1 else None)
        peak, times = 0, []
        for _ in range(steps + 1):  # the first step (shape pass) is not timed
            torch.distributed.barrier()
            start = time.perf_counter()
            result = runner.step(x, y)
            torch.distributed.barrier()
            times.append(time.perf_counter() - start)
            peak = max(peak, result.peak_saved_bytes)
            for stage in mine:
                stage.zero_grad(set_to_none=True)
        out[(case, k, how)] = {"peak": peak, "step_s": statistics.median(times[1:])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=2, help="pipeline ranks (default 2)")
    parser.add_argument("-m", type=int, default=4, help="microbatches (default 4)")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--microbatch-size", type=int, default=2, help="sequences per microbatch (default 2)")
    parser.add_argument("--layers", type=int, default=None, help="default 2 per stage")
    parser.add_argument("--chunks", default="2,4", help="k values (default 2,4)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (default 3)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    p, m = args.p, args.m
    model = dict(layers=args.layers or 2 * p, hidden=args.hidden, heads=4, seq=args.seq, vocab=11, dtype="float32")
    chunks = [int(k) for k in args.chunks.split(",")]
    runs = [("split:1f1b", 1, "even")] + [("seq1f1b", k, how) for k in chunks for how in ("even", "balanced")]
    threads = max(1, (os.cpu_count() or 1) // p)
    per_rank = spawn(worker, p, args=(runs, model, m, args.microbatch_size, args.steps), timeout_s=900, threads_per_rank=threads)
    base = per_rank[0][runs[0]]
    rows = []
    for case, k, how in runs:
        got = per_rank[0][(case, k, how)]
        predicted = predicted_peaks("1f1b" if k == 1 else case, p, m, k, how, model, args.microbatch_size)[0]
        split = list(lengths(GPTConfig(**model), k, how)) if k > 1 else [args.seq]
        step = max(r[(case, k, how)]["step_s"] for r in per_rank)
        rows.append({
            "schedule": "1f1b" if k == 1 else "seq1f1b", "k": k, "split": "-" if k == 1 else how, "lengths": split,
            "peak_rank0_bytes": got["peak"], "predicted_rank0_bytes": predicted,
            "memory_vs_1f1b": got["peak"] / base["peak"], "formula": (k + p - 1) / (k * p),
            "step_s": step, "time_vs_1f1b": step / max(r[runs[0]]["step_s"] for r in per_rank),
        })
    print(f"GPT layers={model['layers']} hidden={model['hidden']} seq={args.seq} float32, p={p} m={m}, "
          f"microbatch {args.microbatch_size}, {threads} threads/rank, median of {args.steps} steps")
    print(f"{'schedule':<9}{'k':>3} {'split':<9}{'rank0 peak MiB':>15}{'predicted':>11}{'vs 1f1b':>9}"
          f"{'(k+p-1)/kp':>12}{'step ms':>10}{'vs 1f1b':>9}  lengths")
    for r in rows:
        lens = ",".join(map(str, r["lengths"])) if len(r["lengths"]) <= 8 else f"{len(r['lengths'])} chunks"
        print(f"{r['schedule']:<9}{r['k']:>3} {r['split']:<9}{r['peak_rank0_bytes'] / 2**20:>15.2f}"
              f"{r['predicted_rank0_bytes'] / 2**20:>11.2f}{r['memory_vs_1f1b']:>9.3f}{r['formula']:>12.3f}"
              f"{r['step_s'] * 1e3:>10.1f}{r['time_vs_1f1b']:>9.2f}  {lens}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": model, "p": p, "m": m, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
