"""Workers for the mesh tests (p x d processes), at module level so spawn can pickle them.

`matrix_worker` runs many (schedule, policy) cases in one process group: per case it builds
its stages from the seed, shards them, trains two steps on its replica's slice of the
global batch and returns the full gradients and parameters after the first step, and the
static bytes measured and predicted for both steps.
"""
from __future__ import annotations

import torch

from pipeblocks import schedules
from pipeblocks.core.ir.sharding import parse_sharding, per_stage
from pipeblocks.core.lowering.entry import lower_for
from pipeblocks.models import GPTConfig, cross_entropy
from pipeblocks.models import build_stages
from pipeblocks.runtime import PipelineRunner
from pipeblocks.runtime.data_parallel import DataParallel
from pipeblocks.runtime.mesh import init_mesh
from pipeblocks.core.cost.static_memory import predict_static_peak

MODEL = GPTConfig(layers=4, hidden=8, heads=2, seq=8, vocab=16, dtype="float64")
M = 2  # microbatches per replica
MICROBATCH = 2
LR = 1e-2
SCHEDULES = {  # name -> (generator options, sequence chunks)
    "zb-v": ({}, None),
    "v-half": ({}, None),
    "interleaved-1f1b": ({}, None),
    "seq1f1b": ({}, 2),
}


def global_batch(dp: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    n = dp * M * MICROBATCH
    tokens = torch.randint(0, MODEL.vocab, (n, MODEL.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def build_schedule(name: str, p: int):
    options, k = SCHEDULES[name]
    if k is None:
        return schedules.get(name)(p=p, m=M, **options)
    return schedules.get(name)(p=p, m=M, seq_chunks=k, **options)


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def matrix_worker(ctx, p: int, dp: int, cases: list[tuple[str, str]], given_program: bool = False) -> list[dict]:
    """`given_program`: the runner is handed the Program, lowered here, beside its data_parallel."""
    mesh = init_mesh(p, dp, ctx.device)
    out = []
    for name, policy in cases:
        schedule = build_schedule(name, p)
        mine = schedule.placement.stages_of(mesh.pp_rank)
        built = build_stages(MODEL, seed=0, num_stages=schedule.num_stages, stages=mine, device=ctx.device)
        stages = {s.index: s for s in built}
        shapes = {s.index: [tuple(q.shape) for q in s.parameters()] for s in built}
        policies = per_stage(parse_sharding(policy), schedule.num_stages)
        data_parallel = DataParallel(stages, policies, mesh.dp_mesh, timeout_s=60)
        optimizer = data_parallel.optimizer(torch.optim.AdamW, lr=LR)
        program = lower_for(schedule, policies=policies, dp=dp, check=True) if given_program else None
        runner = PipelineRunner(schedule, stages, cross_entropy, group=mesh.pp_group, timeout_s=60,
                                data_parallel=data_parallel, program=program)
        case = {"case": (name, policy), "pp_rank": mesh.pp_rank, "dp_rank": mesh.dp_rank, "static": []}
        for step in range(2):
            x, y = global_batch(dp, step)
            n = M * MICROBATCH
            x, y = x[mesh.dp_rank * n:(mesh.dp_rank + 1) * n], y[mesh.dp_rank * n:(mesh.dp_rank + 1) * n]
            result = runner.step(x if runner.holds_first_stage else None, y if runner.holds_last_stage else None)
            if step == 0:
                case["loss"] = result.loss
                case["grads"] = {n_: _full(q.grad).detach().clone() for s in built for n_, q in s.named_parameters()}
            optimizer.step()
            data_parallel.sample_static()
            if step == 0:
                case["params"] = {n_: _full(q).detach().clone() for s in built for n_, q in s.named_parameters()}
            predicted = predict_static_peak(runner.program, mesh.pp_rank, shapes, policies, dp=dp,
                                            dp_rank=mesh.dp_rank, element_size=8, optimizer_state=step > 0)
            case["static"].append((data_parallel.peak_static, predicted))
            optimizer.zero_grad(set_to_none=True)
        case["program"] = [str(op) for op in runner.program.ranks[mesh.pp_rank]]
        case["stages"] = list(mine)
        out.append(case)
    return out


def failing_collective_worker(ctx, failing_replica: int) -> None:
    """p=1, d=2: replica `failing_replica` raises inside its gradient reduction while the
    other replica waits in the all-reduce."""
    mesh = init_mesh(1, 2, ctx.device)
    schedule = schedules.get("1f1b")(p=1, m=2)
    built = build_stages(MODEL, seed=0, num_stages=1, stages=(0,), device=ctx.device)
    stages = {0: built[0]}
    data_parallel = DataParallel(stages, parse_sharding("replicate"), mesh.dp_mesh, timeout_s=60)
    if mesh.dp_rank == failing_replica:
        def explode(chunk):
            raise RuntimeError(f"replica {mesh.dp_rank} failed inside its all-reduce on purpose")

        data_parallel._reduce = explode
    runner = PipelineRunner(schedule, stages, cross_entropy, group=mesh.pp_group, timeout_s=60,
                            data_parallel=data_parallel)
    x, y = global_batch(2, 0)
    runner.step(x[:M * MICROBATCH], y[:M * MICROBATCH])
