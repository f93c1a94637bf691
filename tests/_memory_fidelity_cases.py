"""The memory-fidelity matrix: configurations of the reference GPT run in one world of
four processes, measured the way `pipeblocks train` measures them (at module level so
spawn can pickle the worker).

Per case every process trains two steps (the optimizer state exists in the second, which
is the steady state the estimate describes) and returns its peak saved-activation bytes
(the runtime's tracker) and its peak static bytes (parameters, gradients and AdamW state,
sampled after the optimizer step and, with data parallelism, before every op that frees).
Cases of p=4 use the whole world as one pipeline; cases of p=2 run two replicas (dp=2).
"""
from __future__ import annotations

import torch

from pipeblocks import schedules
from pipeblocks.core.ir.sharding import parse_sharding, per_stage
from pipeblocks.models import GPTConfig, cross_entropy
from pipeblocks.models import build_stages
from pipeblocks.runtime import PipelineRunner
from pipeblocks.runtime.data_parallel import DataParallel, held_bytes
from pipeblocks.runtime.mesh import init_mesh
from pipeblocks.sim.analytic import TransformerConfig
from pipeblocks.sim.sequence_split import split_lengths

WORLD = 4
MICROBATCH = 2
# activations are a third to two thirds of each process's total at this size
MODEL = GPTConfig(layers=8, hidden=64, heads=4, seq=64, vocab=256, dtype="float32")
ANALYTIC = TransformerConfig(layers=8, hidden=64, heads=4, seq=64, vocab=256, microbatch_size=MICROBATCH,
                             dtype="fp32", flash_attention=True, dropout=False)
CASES = {  # name -> (schedule, p, m, generator options, dp, sharding)
    "1f1b p=4": ("1f1b", 4, 8, {}, 1, "replicate"),
    "v-half p=4": ("v-half", 4, 8, {}, 1, "replicate"),
    "zb-v p=4": ("zb-v", 4, 8, {}, 1, "replicate"),
    "interleaved-1f1b p=4 v=2": ("interleaved-1f1b", 4, 8, {"v": 2}, 1, "replicate"),
    "seq1f1b p=4 k=2": ("seq1f1b", 4, 8, {"seq_chunks": 2}, 1, "replicate"),
    "1f1b p=2 dp=2": ("1f1b", 2, 4, {}, 2, "replicate"),
    "1f1b p=2 dp=2 zero1": ("1f1b", 2, 4, {}, 2, "zero1"),
    "1f1b p=2 dp=2 zero3": ("1f1b", 2, 4, {}, 2, "zero3"),
    "v-half p=2 dp=2 zero2": ("v-half", 2, 4, {}, 2, "zero2"),
}


def build_schedule(case: str):
    name, p, m, options, _, _ = CASES[case]
    return schedules.get(name)(p=p, m=m, **options)


def _batch(n: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, MODEL.vocab, (n, MODEL.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _run_case(ctx, case: str) -> dict:
    schedule = build_schedule(case)
    _, p, m, _, dp, sharding = CASES[case]
    mesh = init_mesh(p, dp, ctx.device) if dp > 1 else None
    rank, replica = (mesh.pp_rank, mesh.dp_rank) if mesh is not None else (ctx.rank, 0)
    mine = schedule.placement.stages_of(rank)
    built = build_stages(MODEL, seed=0, num_stages=schedule.num_stages, stages=mine, device=ctx.device)
    stages = {s.index: s for s in built}
    data_parallel = None
    if mesh is not None:
        policies = per_stage(parse_sharding(sharding), schedule.num_stages)
        data_parallel = DataParallel(stages, policies, mesh.dp_mesh, timeout_s=120)
        optimizer = data_parallel.optimizer(torch.optim.AdamW, lr=1e-3)
    else:
        optimizer = torch.optim.AdamW([q for s in built for q in s.parameters()], lr=1e-3)
    k = schedule.seq_chunks
    lengths = split_lengths(MODEL.seq, k, "balanced", ANALYTIC) if k > 1 else None
    runner = PipelineRunner(schedule, stages, cross_entropy, rank=rank, device=ctx.device, timeout_s=120,
                            seq_lengths=lengths, group=mesh.pp_group if mesh is not None else None,
                            data_parallel=data_parallel)
    activation = static = 0
    n = m * MICROBATCH
    for step in range(2):
        x, y = _batch(dp * n, step)
        x, y = x[replica * n:(replica + 1) * n], y[replica * n:(replica + 1) * n]
        optimizer.zero_grad(set_to_none=True)
        result = runner.step(x if runner.holds_first_stage else None, y if runner.holds_last_stage else None)
        optimizer.step()
        activation = max(activation, result.peak_saved_bytes)
        if data_parallel is not None:  # as the training loop samples it
            data_parallel.sample_static()
            static = max(static, data_parallel.peak_static)
        else:
            tensors = [t for s in built for q in s.parameters() for t in (q, q.grad)]
            tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
            static = max(static, held_bytes(tensors))
    return {"rank": rank, "dp_rank": replica, "activation": activation, "static": static}


def fidelity_worker(ctx, cases: list[str]) -> dict[str, dict]:
    return {case: _run_case(ctx, case) for case in cases}
