"""Copies of one model stage in several chains (DualPipe): their gradients summed each step.

DualPipe's two directions are two chains of a schedule (`Schedule.chains`); stage s and
stage s + S/chains are copies of one model stage (DualPipe, p = 4: stages 0..3 and 4..7,
stage 4 a copy of stage 0 on rank 3). The copies start equal; after each step's backward
`sum_gradients` gives every copy the sum of all copies' gradients, so the same optimizer
step keeps them equal (DeepSeek-V3 sums them the same way). Copies on one rank add
locally; on two ranks they all-reduce over a group of that pair of ranks, created once by
every rank in the same order (the pattern of `tied.TiedWeights`).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..core.ir.schedule import Schedule

__all__ = ["StageCopies"]


@dataclass
class StageCopies:
    """Per model stage this rank holds a copy of: its local copies and, where the other copy
    lives on another rank, the group of the two ranks."""

    local: dict[int, list[nn.Module]]  # model stage -> this rank's copies
    groups: dict[int, object]  # model stage -> process group with the other copy's rank
    timeout: datetime.timedelta | None

    @staticmethod
    def of(schedule: Schedule, stages: Mapping[int, nn.Module], group, data_parallel,
           timeout_s: float | None) -> StageCopies | None:
        """None for a schedule of one chain."""
        if schedule.chains == 1:
            return None
        if group is not None or data_parallel is not None:
            raise ValueError(
                f"schedule {schedule.name!r} holds each stage on {schedule.chains} ranks: its copies sum gradients "
                "over the default process group; run it without data parallelism and without a process group"
            )
        length = schedule.num_stages // schedule.chains
        owners: dict[int, set[int]] = {}
        for stage, owner in enumerate(schedule.placement.stage_to_rank):
            owners.setdefault(stage % length, set()).add(owner)
        pairs = sorted({tuple(sorted(ranks)) for ranks in owners.values() if len(ranks) > 1})
        made = {pair: dist.new_group(list(pair)) for pair in pairs}  # every rank, same order
        local: dict[int, list[nn.Module]] = {}
        for stage in sorted(stages):
            local.setdefault(stage % length, []).append(stages[stage])
        groups = {model: made[tuple(sorted(owners[model]))] for model in local if len(owners[model]) > 1}
        return StageCopies(local, groups, None if timeout_s is None else datetime.timedelta(seconds=timeout_s))

    def sum_gradients(self) -> None:
        """Every copy's parameters get the sum of all copies' gradients (in model-stage order,
        the same on both ranks of a pair)."""
        with torch.no_grad():
            for model in sorted(self.local):
                copies = self.local[model]
                params = [list(module.parameters()) for module in copies]
                for same in zip(*params, strict=True):
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in same]
                    total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
                    group = self.groups.get(model)
                    if group is not None:
                        total = total.clone()
                        work = dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group, async_op=True)
                        work.wait(self.timeout) if self.timeout is not None else work.wait()
                    for p in same:
                        p.grad = total.clone()
