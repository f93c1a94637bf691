"""Per-rank memory: the analytic estimate (`pipeblocks.sim.memory_estimate`, no profiling)
against what `pipeblocks train` measures, for the reference GPT over a few configurations.

    PYTHONPATH=src python benchmarks/memory_fidelity.py [--layers 8] [--hidden 64] [--seq 64]
                                                        [--microbatch-size 2] [--cases a,b] [--json]

Each configuration is one `pipeblocks train` run (the training loop itself, gloo on CPU,
p x dp processes, 2 steps of the embedded corpus); measured = the run's peak static bytes
(parameters, gradients, AdamW state) + its peak saved-activation bytes, per process, as
the run's report gives them. The estimate takes only the model config, the schedule, dp
and the sharding. Columns per process (KiB): estimated static / activation / total,
measured total, estimated / measured; and, for comparison, the total under Megatron's
activation accounting (dropout masks and stored attention scores, which the reference GPT
does not have) over measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from pipeblocks.resolve.request import Mesh, ScheduleRequest
from pipeblocks.models.config import GPTConfig
from pipeblocks.sim.analytic import TransformerConfig
from pipeblocks.sim.memory_estimate import estimate_memory

CASES = {  # name -> (schedule, p, m, generator options, seq chunks, dp, sharding)
    "1f1b p=2": ("1f1b", 2, 4, (), None, 1, "replicate"),
    "1f1b p=4": ("1f1b", 4, 8, (), None, 1, "replicate"),
    "v-half p=4": ("v-half", 4, 8, (), None, 1, "replicate"),
    "zb-v p=2": ("zb-v", 2, 4, (), None, 1, "replicate"),
    "interleaved-1f1b p=2 v=2": ("interleaved-1f1b", 2, 4, (("v", 2),), None, 1, "replicate"),
    "seq1f1b p=2 k=2": ("seq1f1b", 2, 4, (), 2, 1, "replicate"),
    "1f1b p=2 dp=2 zero1": ("1f1b", 2, 4, (), None, 2, "zero1"),
    "1f1b p=2 dp=2 zero3": ("1f1b", 2, 4, (), None, 2, "zero3"),
}


def measure(case: str, model: GPTConfig, microbatch: int) -> tuple:
    from pipeblocks.train.loop import launch
    from pipeblocks.train.run import prepare

    name, p, m, options, k, dp, sharding = CASES[case]
    request = ScheduleRequest(name=name, m=m, mesh=Mesh(pp=p, dp=dp), options=options, seq_chunks=k,
                              sharding=(sharding,))
    cfg, _ = prepare(request, model=model, steps=2, microbatch_size=microbatch, quiet=True, threads_per_rank=1)
    results = launch(cfg)
    return cfg.schedule.schedule, {(r.rank, r.dp_rank): (r.static_bytes_measured, r.peak_activation_bytes) for r in results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated names of: " + ", ".join(CASES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",")]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    model = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=256)
    config = TransformerConfig(layers=model.layers, hidden=model.hidden, heads=model.heads, seq=model.seq,
                               vocab=model.vocab, microbatch_size=args.microbatch_size, dtype="fp32",
                               flash_attention=True, dropout=False)
    megatron = dataclasses.replace(config, flash_attention=False, dropout=True)
    rows = []
    for case in cases:
        schedule, measured = measure(case, model, args.microbatch_size)
        dp, sharding = CASES[case][5], CASES[case][6]
        estimate = estimate_memory(config, schedule, dp=dp, sharding=(sharding,))
        other = estimate_memory(megatron, schedule, dp=dp, sharding=(sharding,))
        for r in estimate.ranks:
            static, activation = measured[(r.rank, r.dp_rank)]
            total = static + activation
            rows.append({
                "case": case, "rank": r.rank, "dp_rank": r.dp_rank,
                "static_estimated": r.static_bytes, "activation_estimated": r.activation_bytes,
                "total_estimated": r.total, "static_measured": static, "activation_measured": activation,
                "total_measured": total, "ratio": r.total / total,
                "ratio_megatron_accounting": other.rank(r.rank, r.dp_rank).total / total,
            })
    if args.json:
        print(json.dumps({"model": dataclasses.asdict(config), "rows": rows}, indent=1))
        return
    print(f"reference GPT: {config.layers} layers, hidden {config.hidden}, seq {config.seq}, vocab {config.vocab}, "
          f"microbatch {config.microbatch_size}, fp32 AdamW; KiB per process")
    print(f"{'case':26s} {'rank':>4} {'dp':>2}  {'static':>8} {'activ.':>8} {'total':>8}  {'measured':>8}  "
          f"{'est/meas':>8}  {'Megatron/meas':>13}")
    for row in rows:
        print(f"{row['case']:26s} {row['rank']:>4} {row['dp_rank']:>2}  {row['static_estimated'] / 1024:8.1f} "
              f"{row['activation_estimated'] / 1024:8.1f} {row['total_estimated'] / 1024:8.1f}  "
              f"{row['total_measured'] / 1024:8.1f}  {row['ratio']:8.4f}  {row['ratio_megatron_accounting']:13.3f}")
    worst = max(abs(row["ratio"] - 1) for row in rows)
    print(f"largest |estimated/measured - 1|: {worst * 100:.2f}%")


if __name__ == "__main__":
    main()
