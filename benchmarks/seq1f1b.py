"""Seq1F1B against 1F1B on long sequences, from the analytic transformer model.

    python benchmarks/seq1f1b.py [--json FILE]

For each configuration: makespan, bubble ratio and rank-0 peak activation of 1F1B and of
Seq1F1B with k chunks cut evenly (equal tokens) or balanced (equal FLOPs under causal
attention), with flash-attention memory (the s x s scores are not stored). The memory
ratio against 1F1B is compared with (k+p-1)/(kp) (the Seq1F1B paper's memory algebra; docs/seq1f1b-memory.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from pipeblocks import schedules, simulate
from pipeblocks.sim.analytic import HARDWARE, TransformerConfig, transformer_costs
from pipeblocks.sim.sequence_split import chunk_shares, split_lengths

# (label, config, p, m): 7B-like and 13B-like decoders at 32k/64k tokens, as in the Seq1F1B paper's runs
CASES = [
    ("7B seq 32k", TransformerConfig(layers=32, hidden=4096, heads=32, seq=32768, flash_attention=True), 8, 8),
    ("7B seq 64k", TransformerConfig(layers=32, hidden=4096, heads=32, seq=65536, flash_attention=True), 8, 8),
    ("13B seq 32k", TransformerConfig(layers=40, hidden=5120, heads=40, seq=32768, flash_attention=True), 8, 16),
]
CHUNKS = (2, 4, 8)


def run(config: TransformerConfig, p: int, m: int) -> list[dict]:
    costs = transformer_costs(config, HARDWARE["a100"], num_stages=p)
    base = simulate(schedules.get("1f1b")(p=p, m=m), costs)
    rows = [{"schedule": "1f1b", "k": 1, "split": "-", "makespan_s": base.makespan, "bubble_ratio": base.bubble_ratio,
             "peak_rank0_gib": base.peak_activation[0] / 2**30, "memory_vs_1f1b": 1.0, "formula": 1.0}]
    for k in CHUNKS:
        schedule = schedules.get("seq1f1b")(p=p, m=m, seq_chunks=k)
        for how in ("even", "balanced"):
            seq_time, seq_mem = chunk_shares(split_lengths(config.seq, k, how, config), config)
            t = simulate(schedule, dataclasses.replace(costs, seq_time=seq_time, seq_mem=seq_mem))
            rows.append({"schedule": "seq1f1b", "k": k, "split": how, "makespan_s": t.makespan,
                         "bubble_ratio": t.bubble_ratio, "peak_rank0_gib": t.peak_activation[0] / 2**30,
                         "memory_vs_1f1b": t.peak_activation[0] / base.peak_activation[0],
                         "formula": (k + p - 1) / (k * p)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    report = {}
    for label, config, p, m in CASES:
        rows = run(config, p, m)
        report[label] = {"p": p, "m": m, "config": dataclasses.asdict(config), "rows": rows}
        print(f"\n{label}: {config.layers} layers, hidden {config.hidden}, p={p}, m={m}, A100 model, flash attention")
        print(f"{'schedule':<9} {'k':>2} {'split':<9} {'makespan s':>10} {'bubble':>7} {'rank0 GiB':>9} "
              f"{'vs 1F1B':>7} {'(k+p-1)/kp':>10}")
        for r in rows:
            print(f"{r['schedule']:<9} {r['k']:>2} {r['split']:<9} {r['makespan_s']:>10.3f} {r['bubble_ratio']:>7.4f} "
                  f"{r['peak_rank0_gib']:>9.1f} {r['memory_vs_1f1b']:>7.3f} {r['formula']:>10.3f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
