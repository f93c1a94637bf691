"""`ChunkOptimizers`: one optimizer per chunk of a pipeline rank, stepped together.

    optimizers = ChunkOptimizers({0: torch.optim.AdamW(stage0.parameters()), 2: zero1_optimizer},
                                 after_step=lambda stage: print(f"stage {stage} stepped"))
    optimizers = ChunkOptimizers.for_chunks(dp.chunks, torch.optim.AdamW, dp.group, None, lr=3e-3)
    optimizers.step(); optimizers.zero_grad()

`DataParallel.optimizer` builds one with `for_chunks`: each chunk's sharding policy decides
the kind (torch's ZeroRedundancyOptimizer over the dp group for zero1, the given class over
the sharded or plain parameters otherwise), and `after_step` issues the next step's first
gathers of the chunk (`dp_overlap.GathersAhead`). `state_tensors` lists the optimizer state
the static bytes count.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..core.ir.sharding import ShardingPolicy
from .dp_chunks import ChunkState

__all__ = ["ChunkOptimizers"]


class ChunkOptimizers:
    """One optimizer per chunk (each chunk's policy decides which kind), stepped together.
    after_step(stage), if given, runs as soon as a chunk's optimizer has stepped (the
    DataParallel issues the next step's first gathers of the chunk there)."""

    def __init__(self, optimizers: Mapping[int, torch.optim.Optimizer], *,
                 after_step: Callable[[int], None] | None = None) -> None:
        self.by_stage = dict(optimizers)
        self.after_step = after_step

    @classmethod
    def for_chunks(cls, chunks: Mapping[int, ChunkState], optimizer_class: Callable[..., torch.optim.Optimizer],
                   group: dist.ProcessGroup, after_step: Callable[[int], None] | None, /,
                   **defaults) -> ChunkOptimizers:
        """One optimizer per chunk: `optimizer_class` over its trainable (sharded) parameters,
        or under ZeroRedundancyOptimizer on `group` for zero1 chunks; `defaults` go to each."""
        optimizers: dict[int, torch.optim.Optimizer] = {}
        for stage, chunk in chunks.items():
            params = [p for p in chunk.own_params if p.requires_grad]
            if chunk.policy is ShardingPolicy.ZERO1:
                optimizers[stage] = ZeroRedundancyOptimizer(
                    params, optimizer_class=optimizer_class, process_group=group, **defaults
                )
            else:
                optimizers[stage] = optimizer_class(params, **defaults)
        return cls(optimizers, after_step=after_step)

    def step(self) -> None:
        for stage, optimizer in self.by_stage.items():
            optimizer.step()
            if self.after_step is not None:
                self.after_step(stage)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.by_stage.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_tensors(self) -> list[torch.Tensor]:
        out = []
        for optimizer in self.by_stage.values():
            inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
            for state in inner.state.values():
                out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return out
