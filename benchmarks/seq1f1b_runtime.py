"""Seq1F1B against 1F1B in the runtime, on CPU: measured rank-0 memory and iteration time.

    python benchmarks/seq1f1b_runtime.py [-p 4] [-m 8] [--seq 256,1024] [--chunks 4] [--splits even] [--json FILE]

A small GPT (float32, 2 sequences per microbatch, 2 layers per stage) is trained for a few
steps by `PipelineRunner` on p local gloo processes under 1F1B and under Seq1F1B with k
chunks cut evenly (equal tokens) or balanced (equal FLOPs under causal attention), at each
sequence length. Per run, rank 0's measured peak saved-activation bytes against 1F1B's
(`measured`), beside:

  formula     (k+p-1)/(kp), the Seq1F1B paper's ratio for equal chunks;
  +K/V        the formula plus the K/V share: every microbatch rank 0 holds a chunk of keeps
              one K/V buffer of the whole sequence (kv = its part of a microbatch's saved
              bytes, n = buffers held at once): formula + kv * (n/p - formula);
  simulator   the simulator's ratio, fed per-stage bytes and per-chunk shares profiled from
              the same model (`profile_stage_memory`, `profile_chunk_memory`);

and the median step time after a warm-up step. CPU times show the runtime's cost of k-fold
more, smaller passes; the bubble gain of Seq1F1B needs passes long enough to hide them.
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

from _sequence_cases import build, kv_ratio, lengths, predicted_peaks  # noqa: E402


def worker(ctx, runs: list[tuple[int, str, int, str]], models: dict, m: int, b: int, steps: int) -> dict:
    """Per run (seq, case, k, split): this rank's peak saved bytes and its step times."""
    out = {}
    for seq, case, k, how in runs:
        cfg = GPTConfig(**models[seq])
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab, (m * b, cfg.seq + 1), generator=gen)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
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
        out[(seq, case, k, how)] = {"peak": peak, "step_s": statistics.median(times[1:])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=4, help="pipeline ranks (default 4)")
    parser.add_argument("-m", type=int, default=8, help="microbatches (default 8)")
    parser.add_argument("--seq", default="256,1024", help="tokens per sequence, comma-separated (default 256,1024)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--microbatch-size", type=int, default=2, help="sequences per microbatch (default 2)")
    parser.add_argument("--layers", type=int, default=None, help="default 2 per stage")
    parser.add_argument("--chunks", default="4", help="k values (default 4)")
    parser.add_argument("--splits", default="even", help="even, balanced or both: even,balanced (default even)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run (default 2)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    p, m, b = args.p, args.m, args.microbatch_size
    seqs = [int(s) for s in args.seq.split(",")]
    models = {s: dict(layers=args.layers or 2 * p, hidden=args.hidden, heads=4, seq=s, vocab=11, dtype="float32")
              for s in seqs}
    chunks = [int(k) for k in args.chunks.split(",")]
    splits = args.splits.split(",")
    runs = [r for s in seqs for r in [(s, "split:1f1b", 1, "even")] + [(s, "seq1f1b", k, h) for k in chunks for h in splits]]
    threads = max(1, (os.cpu_count() or 1) // p)
    per_rank = spawn(worker, p, args=(runs, models, m, b, args.steps), timeout_s=1800, threads_per_rank=threads)
    rows = []
    for seq, case, k, how in runs:
        if k == 1:
            continue
        model, base = models[seq], (seq, "split:1f1b", 1, "even")
        got, got_base = per_rank[0][(seq, case, k, how)], per_rank[0][base]
        predicted = predicted_peaks(case, p, m, k, how, model, b)[0]
        predicted_base = predicted_peaks("1f1b", p, m, 1, how, model, b)[0]
        closed = kv_ratio(case, p, m, k, model, b)
        step = max(r[(seq, case, k, how)]["step_s"] for r in per_rank)
        step_base = max(r[base]["step_s"] for r in per_rank)
        rows.append({
            "p": p, "k": k, "seq": seq, "split": how, "lengths": list(lengths(GPTConfig(**model), k, how)),
            "peak_rank0_bytes": got["peak"], "peak_rank0_1f1b_bytes": got_base["peak"],
            "measured": got["peak"] / got_base["peak"], "formula": closed["formula"],
            "kv_fraction": closed["kv_fraction"], "kv_buffers": closed["buffers"], "formula_kv": closed["formula_kv"],
            "simulator": predicted / predicted_base, "step_s": step, "step_1f1b_s": step_base,
        })
    print(f"GPT {models[seqs[0]]['layers']} layers, hidden {args.hidden}, float32, p={p} m={m}, microbatch {b}, "
          f"{threads} threads/rank, median of {args.steps} steps; rank 0 peak saved bytes against 1F1B")
    print(f"{'p':>2}{'k':>3}{'seq':>6} {'split':<9}{'1f1b MiB':>9}{'measured':>9}{'formula':>8}{'kv':>6}{'n':>3}"
          f"{'+K/V':>7}{'simulator':>10}{'|meas-(+K/V)|':>14}{'time vs 1f1b':>13}")
    for r in rows:
        print(f"{r['p']:>2}{r['k']:>3}{r['seq']:>6} {r['split']:<9}{r['peak_rank0_1f1b_bytes'] / 2**20:>9.2f}"
              f"{r['measured']:>9.3f}{r['formula']:>8.3f}{r['kv_fraction']:>6.3f}{r['kv_buffers']:>3}"
              f"{r['formula_kv']:>7.3f}{r['simulator']:>10.3f}{abs(r['measured'] - r['formula_kv']):>14.3f}"
              f"{r['step_s'] / r['step_1f1b_s']:>13.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"models": models, "p": p, "m": m, "microbatch": b, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
