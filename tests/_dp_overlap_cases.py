"""Workers for the block-grain overlap tests (p=1 x d=2, at module level so spawn can
pickle them): per case (schedule, policy, every REDUCE_GRAD at the end of the step), a
4-layer GPT stage (or two, for a V) with one DP unit per block, trained three steps with `gather_ahead` on and three with it off, from the same seed and
batches; returned: the DataParallel's event log per step, the full gradients of the first
step, the losses and the full parameters after every step, and whether the parameters were
sharded after the last step."""
from __future__ import annotations

import torch

from pipeblocks import schedules
from pipeblocks.core.ir.dp_units import units_for
from pipeblocks.core.ir.sharding import parse_sharding, per_stage
from pipeblocks.models import GPTConfig, cross_entropy
from pipeblocks.models import build_stages
from pipeblocks.runtime import PipelineRunner
from pipeblocks.runtime.data_parallel import DataParallel
from pipeblocks.runtime.mesh import init_mesh

MODEL = GPTConfig(layers=4, hidden=8, heads=2, seq=8, vocab=16, dtype="float64")
M = 2  # microbatches per replica
MICROBATCH = 2
LR = 1e-2
STEPS = 3


def global_batch(dp: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(0, MODEL.vocab, (dp * M * MICROBATCH, MODEL.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _run(ctx, mesh, name: str, policy: str, at_end: bool, gather_ahead: bool) -> dict:
    schedule = schedules.get(name)(p=1, m=M)
    built = build_stages(MODEL, seed=0, num_stages=schedule.num_stages, stages=tuple(range(schedule.num_stages)),
                         device=ctx.device)
    stages = {s.index: s for s in built}
    blocks = tuple(len(s.block_items()) for s in built)
    units = units_for("block", blocks)
    policies = per_stage(parse_sharding(policy), schedule.num_stages)
    dp = DataParallel(stages, policies, mesh.dp_mesh, timeout_s=60, units=units, reduce_at_end=at_end,
                      gather_ahead=gather_ahead)
    optimizer = dp.optimizer(torch.optim.AdamW, lr=LR)
    runner = PipelineRunner(schedule, stages, cross_entropy, group=mesh.pp_group, timeout_s=60, data_parallel=dp)
    out = {"steps": [], "losses": [], "params": []}
    n = M * MICROBATCH
    for step in range(STEPS):
        x, y = global_batch(2, step)
        x, y = x[mesh.dp_rank * n:(mesh.dp_rank + 1) * n], y[mesh.dp_rank * n:(mesh.dp_rank + 1) * n]
        dp.events.clear()
        result = runner.step(x, y)
        if step == 0:
            out["grads"] = {k: _full(q.grad).detach().clone() for s in built for k, q in s.named_parameters()}
        optimizer.step()
        out["steps"].append([tuple(e) for e in dp.events])
        out["losses"].append(result.loss)
        out["params"].append({k: _full(q).detach().clone() for s in built for k, q in s.named_parameters()})
        optimizer.zero_grad(set_to_none=True)
    # a checkpoint between steps reads the state dict: sharded even with the next gathers in flight
    out["sharded_state"] = all(hasattr(t, "full_tensor") for s in built for t in s.state_dict().values()
                               if isinstance(t, torch.Tensor) and t.is_floating_point()) if policy == "zero3" else None
    dp.drop_gathers_ahead()
    out["sharded_after_drop"] = all(hasattr(q, "full_tensor") for s in built for q in s.parameters())
    out["program"] = [str(op) for op in runner.program.ranks[0]]
    return out


def overlap_worker(ctx, cases: list[tuple[str, str, bool]]) -> list[dict]:
    mesh = init_mesh(1, 2, ctx.device)
    results = []
    for name, policy, at_end in cases:
        on = _run(ctx, mesh, name, policy, at_end, gather_ahead=True)
        off = _run(ctx, mesh, name, policy, at_end, gather_ahead=False)
        results.append({"case": (name, policy, at_end), "dp_rank": mesh.dp_rank, "on": on, "off": off})
    return results
