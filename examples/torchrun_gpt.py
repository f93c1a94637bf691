"""Train the reference GPT with any pipeblocks schedule under torchrun.

One process per pipeline rank, on one machine or many (torchrun's environment
rendezvous); gloo on CPU, NCCL when CUDA is there:

    torchrun --nproc-per-node 4 examples/torchrun_gpt.py --schedule v-half --microbatches 8 --steps 20
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 examples/torchrun_gpt.py --schedule zb-v

Each rank builds only its own stages (the weights equal those of the full model built from
the same seed), reads the same deterministic batch, and steps its optimizer after the
flush. The rank holding the last stage prints the loss.

With `--checkpoint DIR` every rank saves its stages and optimizer there at the end, and
`--resume` continues from the newest step all ranks saved. SIGTERM (what torchrun sends
every worker when it is itself stopped), SIGINT or SIGHUP ends the run after the step in
progress, the same step on every rank, with a checkpoint when --checkpoint is given.
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
from pipeblocks.train import checkpoint as ckpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None, metavar="DIR", help="save here at the end and when stopped")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in DIR")
    args = parser.parse_args()
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint DIR")

    ctx = init_from_env(stop_signals=True)
    cfg = GPTConfig()
    schedule = schedules.get(args.schedule)(p=ctx.world_size, m=args.microbatches)
    stage_ids = schedule.placement.stages_of(ctx.rank)
    stages = build_stages(cfg, seed=args.seed, num_stages=schedule.num_stages, stages=stage_ids, device=ctx.device)
    params = [p for stage in stages for p in stage.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    mine = dict(zip(stage_ids, stages))
    meta = {"schedule": schedule.name, "p": schedule.p, "m": schedule.m, "seed": args.seed,
            "microbatch_size": args.microbatch_size, "lr": args.lr}
    start = 0
    if args.resume:
        found = ckpt.latest_step(args.checkpoint, ctx.world_size)
        if found is None:
            raise SystemExit(f"--resume: no checkpoint that every rank saved in {args.checkpoint!r}")
        state = ckpt.load_rank(args.checkpoint, rank=ctx.rank, step=found)
        ckpt.check_meta(state["meta"], meta, args.checkpoint)
        start = ckpt.restore_rank(state, mine, optimizer)
    runner = PipelineRunner(schedule, mine, cross_entropy, rank=ctx.rank, optimizer=optimizer)
    data = TokenWindows.load(None, seq=cfg.seq)
    done = start
    for step in range(start, args.steps):
        inputs, targets = data.batch(step, args.microbatches * args.microbatch_size, seed=args.seed)
        result = runner.step(inputs.to(ctx.device), targets.to(ctx.device))
        done = step + 1
        if result.loss is not None:
            print(f"step {done}/{args.steps}  loss {result.loss:.4f}", flush=True)
        if ctx.control.step_done(done):  # a stop signal reached some rank: every rank stops here
            print(f"rank {ctx.rank}: stopped by {ctx.control.stop_reason} after step {done}", flush=True)
            break
    if args.checkpoint:
        ckpt.save_rank(args.checkpoint, rank=ctx.rank, step=done, stages=mine, optimizer=optimizer, meta=meta)
    # every rank leaves its last collective before any rank tears the group down
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
