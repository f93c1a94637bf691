"""A chunk as `DataParallel` holds it: its parameters put on torch's own sharding machinery
by its policy, and the state the Program's DP ops move.

    chunk = shard_chunk(2, stage, ShardingPolicy.ZERO3, dp_mesh, unit_sizes=(2, 2))
    chunk.units[1].fsdp.unshard(async_op=True)           # 2UNSHARD.1 (block grain)
    reduce_scatter_chunk(chunk.module, reshard=False)    # chunk grain: 2REDUCE_GRAD, once per step

Under zero2, zero3 and zero3-regather the chunk is an FSDP2 module (`fully_shard(module,
mesh=dp, reshard_after_forward=False)`), at block grain one FSDP2 group per unit with the
stage as root (`dp_units.shard_units`); under replicate and zero1 it stays a plain module.

Gradient sync, reshard-after-backward and last-backward are off for every microbatch, so
FSDP's own backward hooks only accumulate; the REDUCE_GRAD op turns them on and runs
FSDP's post-backward for the chunk (as torch.distributed.pipelining's `perform_reduce_grad`
does), once per chunk per step (at block grain, per unit inside the last pass:
`dp_overlap`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..core.ir.sharding import FSDP_POLICIES, ShardingPolicy
from .dp_units import GradBucket, GradReadiness, shard_units, unit_modules

__all__ = ["ChunkState", "UnitState", "accumulate_only", "reduce_scatter_chunk", "shard_chunk"]



@dataclass
class UnitState:
    """One unit of a chunk at block grain: its modules' parameters and, under FSDP2, the
    module whose unshard()/reshard() moves it."""

    index: int
    params: list[torch.Tensor]
    fsdp: FSDPModule | None = None
    handle: object | None = None
    gathered: bool = False
    reduced: bool = False
    launched: bool = False  # its reduction was launched inside the pass (REDUCE_GRAD finds it in flight)
    ahead: bool = False  # `handle` is the next step's gather, issued after the optimizer step


@dataclass
class ChunkState:
    stage: int
    policy: ShardingPolicy
    module: torch.nn.Module
    own_params: list[torch.Tensor]  # the registered parameters (DTensor shards under FSDP2)
    gathered: bool = False
    unshard_handle: object | None = None
    reductions: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    reducing: bool = False
    units: list[UnitState] | None = None  # block grain: the chunk's units (None: one, the chunk)
    buckets: list[GradBucket] = field(default_factory=list)
    readiness: GradReadiness | None = None  # block grain: launches each unit's reduction inside the pass
    ahead: bool = False  # chunk grain: `unshard_handle` is the next step's gather (after the optimizer step)


def shard_chunk(stage: int, module: torch.nn.Module, policy: ShardingPolicy, dp_mesh, *,
                unit_sizes: Sequence[int] | None = None, mp_policy=None) -> ChunkState:
    """`module` (global stage `stage`) sharded by `policy` on `dp_mesh` and set to accumulate
    only; unit_sizes: the blocks of each unit at block grain (None: chunk grain). The
    chunk's `readiness` is left for its owner to set."""
    groups = unit_modules(module, unit_sizes) if unit_sizes is not None else None
    handles: list = [None] * len(groups or ())
    if policy in FSDP_POLICIES:
        if groups is None:
            extra = {"mp_policy": mp_policy} if mp_policy is not None else {}
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, **extra)
        else:
            handles = shard_units(module, groups, mesh=dp_mesh, mp_policy=mp_policy)
        accumulate_only(module)
    chunk = ChunkState(stage, policy, module, list(module.parameters()))
    if groups is not None:
        chunk.units = [UnitState(u, [p for m in modules for p in m.parameters()], fsdp)
                       for u, (modules, fsdp) in enumerate(zip(groups, handles))]
        _check_units_cover(chunk)
    return chunk


def _check_units_cover(chunk: ChunkState) -> None:
    """Every parameter of a chunk at block grain in exactly one unit, but those of parts
    shared by every stage (the root's own)."""
    seen: dict[int, int] = {}
    for unit in chunk.units:
        for param in unit.params:
            if id(param) in seen:
                raise ValueError(f"stage {chunk.stage}: a parameter is in DP units {seen[id(param)]} and {unit.index}; "
                                 "a unit holds whole blocks, each block in one unit")
            seen[id(param)] = unit.index


def accumulate_only(module: FSDPModule) -> None:
    """Per microbatch: no reduce-scatter, no reshard, not the last backward (FSDP2 flags)."""
    module.set_requires_gradient_sync(False)
    module.set_reshard_after_backward(False)
    module.set_is_last_backward(False)


def reduce_scatter_chunk(module: FSDPModule, *, reshard: bool) -> None:
    """FSDP2's post-backward for the whole module with gradient sync on: reduce-scatters the
    accumulated gradients into the sharded parameters' `.grad` (as torch's pipelining
    schedules do at REDUCE_GRAD); then back to accumulate-only for the next step."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(reshard)
    module.set_requires_gradient_sync(True)
    try:
        state = fully_shard.state(module)
        for inner in state._state_ctx.all_states:
            for group in inner._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
    finally:
        accumulate_only(module)
