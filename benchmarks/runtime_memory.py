"""Measured peak saved-activation bytes per rank vs the simulator's prediction.

    PYTHONPATH=src python benchmarks/runtime_memory.py --p 3 --m 6

Every schedule runs the same model (2p residual MLP blocks plus embedding and head, cut
into the schedule's stages) for real on gloo. The prediction feeds `simulate` the
per-stage M_B that `profile_stage_memory` measures on one microbatch (mem_w_ratio 1: the
graph split keeps everything but the loss region until W).
"""
from __future__ import annotations

import argparse

import torch

from pipeblocks import schedules
from pipeblocks.runtime import PipelineRunner, spawn
from pipeblocks.runtime.profile import profile_stage_memory
from _toy import toy_schedules
from pipeblocks.models.toy import ToyConfig, cross_entropy, toy_batch, toy_stages
from pipeblocks.sim import Costs, simulate

MICROBATCH = 2


def _config(num_stages: int, p: int, hidden: int) -> ToyConfig:
    return ToyConfig(vocab=32, hidden=hidden, seq=16, blocks_per_stage=2 * p // num_stages)


def _worker(ctx, names, p, m, hidden):
    out = {}
    for name in names:
        schedule = schedules.get(name)(p=p, m=m)
        config = _config(schedule.num_stages, p, hidden)
        stages = toy_stages(schedule.num_stages, config)
        mine = {s: stages[s] for s in schedule.placement.stages_of(ctx.rank)}
        runner = PipelineRunner(schedule, mine, cross_entropy, timeout_s=120)
        x, y = toy_batch(MICROBATCH * m, config)
        runner.step(x, y)
        out[name] = runner.step(x, y).peak_saved_bytes
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=3)
    parser.add_argument("--m", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=32)
    args = parser.parse_args()
    names = toy_schedules(args.p, args.m, schedules.names())
    per_rank = spawn(_worker, args.p, args=(names, args.p, args.m, args.hidden), timeout_s=600, threads_per_rank=1)
    print(f"p={args.p} m={args.m}: peak saved activation per rank, KiB (measured / predicted)")
    print(f"{'schedule':18s} " + " ".join(f"{'rank ' + str(r):>17s}" for r in range(args.p)) + f" {'max err':>8s}")
    for name in names:
        schedule = schedules.get(name)(p=args.p, m=args.m)
        config = _config(schedule.num_stages, args.p, args.hidden)
        x, y = toy_batch(MICROBATCH, config)
        profile = profile_stage_memory(toy_stages(schedule.num_stages, config), x, cross_entropy, y)
        predicted = simulate(schedule, Costs(mem_b=tuple(float(s.m_b) for s in profile))).peak_activation
        measured = [r[name] for r in per_rank]
        cells = " ".join(f"{got / 1024:8.1f}/{want / 1024:8.1f}" for got, want in zip(measured, predicted))
        err = max(abs(got - want) / want for got, want in zip(measured, predicted))
        print(f"{name:18s} {cells} {err * 100:7.1f}%")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
