"""Train the reference GPT with any pipeblocks schedule under torchrun.

One process per pipeline rank, on one machine or many (torchrun's environment
rendezvous); gloo on CPU, NCCL when CUDA is there:

    torchrun --nproc-per-node 4 examples/torchrun_gpt.py --schedule v-half --microbatches 8 --steps 20
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 examples/torchrun_gpt.py --schedule zb-v

Each rank builds only its own stages (the weights equal those of the full model built from
the same seed), reads the same deterministic batch, and steps its optimizer after the
flush. The rank holding the last stage prints the loss.
"""
from __future__ import annotations

import argparse

import torch

from pipeblocks import schedules
from pipeblocks.data.text import TokenWindows
from pipeblocks.models.config import GPTConfig
from pipeblocks.models.gpt import cross_entropy
from pipeblocks.models.split import build_stages
from pipeblocks.runtime import PipelineRunner, init_from_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    ctx = init_from_env()
    cfg = GPTConfig()
    schedule = schedules.get(args.schedule)(p=ctx.world_size, m=args.microbatches)
    stage_ids = schedule.placement.stages_of(ctx.rank)
    stages = build_stages(cfg, seed=args.seed, num_stages=schedule.num_stages, stages=stage_ids, device=ctx.device)
    params = [p for stage in stages for p in stage.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    runner = PipelineRunner(schedule, dict(zip(stage_ids, stages)), cross_entropy, rank=ctx.rank, optimizer=optimizer)
    data = TokenWindows.load(None, seq=cfg.seq)
    for step in range(args.steps):
        inputs, targets = data.batch(step, args.microbatches * args.microbatch_size, seed=args.seed)
        result = runner.step(inputs.to(ctx.device), targets.to(ctx.device))
        if result.loss is not None:
            print(f"step {step + 1}/{args.steps}  loss {result.loss:.4f}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
