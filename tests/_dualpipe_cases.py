"""Spawned workers of the DualPipe runtime tests (importable by name)."""
from __future__ import annotations

import torch

from pipeblocks import schedules
from pipeblocks.runtime import PipelineRunner
from pipeblocks.models.toy import cross_entropy, toy_batch, toy_stages

from _runtime_cases import CONFIG, MICROBATCH


class Hooked(torch.nn.Module):
    """A stage with DualPipe's overlap hook: the forward of one microbatch, then the backward
    of another, counted per process."""

    calls = 0

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                    output_grads1):
        cls.calls += 1
        outputs0 = module0(inputs0)
        loss0 = criterion0(outputs0, labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
        else:
            torch.autograd.backward(outputs1, output_grads1)
        return outputs0, loss0


def hooked_worker(ctx, m: int) -> dict:
    """Two steps of dualpipev through the hook; the second step's loss, gradients, hook calls."""
    schedule = schedules.get("dualpipev")(p=ctx.world_size, m=m)
    stages = toy_stages(schedule.num_stages, CONFIG)
    mine = {s: Hooked(stages[s]) for s in schedule.placement.stages_of(ctx.rank)}
    runner = PipelineRunner(schedule, mine, cross_entropy, timeout_s=30.0)
    x0, y0 = toy_batch(MICROBATCH * m, CONFIG, seed=1)
    runner.step(x0, y0)
    for module in mine.values():
        module.zero_grad(set_to_none=True)
    before = Hooked.calls
    x1, y1 = toy_batch(MICROBATCH * m, CONFIG, seed=2)
    result = runner.step(x1, y1)
    return {
        "loss": result.loss,
        "grads": {s: [p.grad.clone() for p in mod.parameters()] for s, mod in mine.items()},
        "calls": Hooked.calls - before,
    }


def copies_worker(ctx, m: int, steps: int) -> dict:
    """DualPipe with each model stage's two copies: `steps` steps of SGD, then the last step's
    loss and, per model stage, the copies' weights and the gradients they summed."""
    import copy

    schedule = schedules.get("dualpipe")(p=ctx.world_size, m=m)
    p = ctx.world_size
    model = toy_stages(p, CONFIG)
    mine = {s: (model[s] if s < p else copy.deepcopy(model[s - p])) for s in schedule.placement.stages_of(ctx.rank)}
    params = [q for module in mine.values() for q in module.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    runner = PipelineRunner(schedule, mine, cross_entropy, timeout_s=30.0, optimizer=optimizer)
    out = {"losses": [], "grads": {}}
    for step in range(steps):
        x, y = toy_batch(MICROBATCH * m, CONFIG, seed=1 + step)
        if step == steps - 1:
            runner.optimizer = None  # keep the last step's gradients to compare
        out["losses"].append(runner.step(x, y).loss)
    out["grads"] = {s: [q.grad.clone() for q in module.parameters()] for s, module in mine.items()}
    out["weights"] = {s: [q.detach().clone() for q in module.parameters()] for s, module in mine.items()}
    return out


def copies_reference(p: int, m: int, steps: int) -> tuple[list[float], list[list[torch.Tensor]], list]:
    """One process, the p-stage model: the same SGD steps; the last step's loss, gradients and
    the weights it had (before the last step's update, as the pipeline leaves them)."""
    model = toy_stages(p, CONFIG)
    params = [q for module in model for q in module.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        x, y = toy_batch(MICROBATCH * m, CONFIG, seed=1 + step)
        h = x
        for stage in model:
            h = stage(h)
        loss = cross_entropy(h, y)
        loss.backward()
        losses.append(loss.item())
        if step < steps - 1:
            optimizer.step()
    return losses, [[q.grad for q in module.parameters()] for module in model], [
        [q.detach() for q in module.parameters()] for module in model]


def both_worker(ctx, m: int, steps: int) -> dict:
    """One spawn for both runtime tests: DualPipeV through the hook, DualPipe's copies."""
    return {"hooked": hooked_worker(ctx, m), "copies": copies_worker(ctx, m, steps)}
