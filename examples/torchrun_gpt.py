"""Train the reference GPT with any pipeblocks schedule under torchrun.

One process per pipeline rank and replica, on one machine or many (torchrun's environment
rendezvous); gloo on CPU, NCCL when CUDA is there:

    torchrun --nproc-per-node 4 examples/torchrun_gpt.py --schedule v-half --microbatches 8 --steps 20
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 examples/torchrun_gpt.py --schedule zb-v
    torchrun --nproc-per-node 4 examples/torchrun_gpt.py --schedule zb-v --dp 2 --sharding zero3

Each rank builds only its own stages (the weights equal those of the full model built from
the same seed), reads the same deterministic batch, and steps its optimizer after the
flush. The rank holding the last stage prints the loss.

With --dp D the processes form a (pp, dp) mesh of p = world/D pipeline ranks (or --pp) by
D replicas; each replica trains on its slice of the D x m-microbatch global batch, and
--sharding (replicate, zero1, zero2, zero3, or one per chunk) shards each chunk over the
replicas. p x D must equal the world size: otherwise the run stops before training.

With `--checkpoint DIR` every rank saves its stages and optimizer there at the end, and
`--resume` continues from the newest step all ranks saved (one replica, no sharding).
SIGTERM (what torchrun sends every worker when it is itself stopped), SIGINT or SIGHUP
ends the run after the step in progress, the same step on every rank, with a checkpoint
when --checkpoint is given.
"""
from __future__ import annotations

import argparse

import torch

from pipeblocks import schedules
from pipeblocks.core.ir.sharding import parse_sharding, per_stage
from pipeblocks.data import TokenWindows
from pipeblocks.models.config import GPTConfig
from pipeblocks.models.spec import cross_entropy
from pipeblocks.models import build_stages
from pipeblocks.runtime import PipelineRunner, init_from_env
from pipeblocks.runtime.data_parallel import DataParallel
from pipeblocks.runtime.mesh import check_world_size, init_mesh
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
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    parser.add_argument("--pp", type=int, default=None, help="pipeline ranks (default: world size / --dp)")
    parser.add_argument("--sharding", default="replicate", help="replicate, zero1, zero2, zero3, or one per chunk")
    args = parser.parse_args()
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint DIR")
    policies = parse_sharding(args.sharding)
    sharded = args.dp > 1 or any(str(p) != "replicate" for p in policies)
    if args.checkpoint and sharded:
        parser.error("--checkpoint needs --dp 1 --sharding replicate (sharded checkpoints are not supported yet)")

    ctx = init_from_env(stop_signals=True)
    pp = args.pp if args.pp is not None else max(1, ctx.world_size // args.dp)
    check_world_size(pp, args.dp, ctx.world_size)  # before anything is built or run
    cfg = GPTConfig()
    schedule = schedules.get(args.schedule)(p=pp, m=args.microbatches)
    mesh = init_mesh(pp, args.dp, ctx.device)
    stage_ids = schedule.placement.stages_of(mesh.pp_rank)
    stages = build_stages(cfg, seed=args.seed, num_stages=schedule.num_stages, stages=stage_ids, device=ctx.device)
    mine = dict(zip(stage_ids, stages))
    data_parallel = None
    if sharded:  # FSDP2 replaces the parameters by their shards: the optimizers are built over those
        data_parallel = DataParallel(mine, per_stage(policies, schedule.num_stages), mesh.dp_mesh)
        optimizer = data_parallel.optimizer(torch.optim.AdamW, lr=args.lr)
    else:
        optimizer = torch.optim.AdamW([p for stage in stages for p in stage.parameters()], lr=args.lr)
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
    runner = PipelineRunner(schedule, mine, cross_entropy, group=mesh.pp_group, optimizer=optimizer,
                            data_parallel=data_parallel)
    data = TokenWindows.load(None, seq=cfg.seq)
    n = args.microbatches * args.microbatch_size  # one replica's sequences per step
    done = start
    for step in range(start, args.steps):
        inputs, targets = data.batch(step, args.dp * n, seed=args.seed)
        share = slice(mesh.dp_rank * n, (mesh.dp_rank + 1) * n)
        result = runner.step(inputs[share].to(ctx.device), targets[share].to(ctx.device))
        done = step + 1
        if result.loss is not None and mesh.dp_rank == 0:
            print(f"step {done}/{args.steps}  loss {result.loss:.4f}" + (" (replica 0)" if args.dp > 1 else ""),
                  flush=True)
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
