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
