"""Tensor parallelism of a pipeline stage, by torch's own DTensor (`parallelize_module`).

    mesh = init_mesh(pp=2, dp=1, tp=2, device=ctx.device)
    for stage in my_stages:                                   # models.stage.Stage, built whole
        parallelize_stage(stage, spec.tp_plan(), mesh.tp_mesh)     # models.tp_plan
    # then FSDP2 (runtime.data_parallel) and the optimizer, over the sharded parameters

TP comes first, then sharding, as torchtitan composes them: `parallelize_stage` replaces
the stage's parameters by DTensors on the "tp" mesh (each rank keeps 1/t of every
projection and embedding; norms are replicated), and FSDP2 then shards those over "dp".

What crosses between stages is the token shard. Inside a stage the hidden state between
blocks is a DTensor sharded along the sequence (Shard(1): sequence parallelism, the plan's
norms run on it); a stage that does not end the model returns its local shard, [b, s/t, h],
and a stage that does not begin it takes that shard and wraps it again, so the pipeline's
point-to-point transfers carry 1/t of the activation on each of the t ranks of a stage
(Megatron's scatter/gather between stages). The last stage returns whole logits, the same
on every tp rank, and every tp rank computes the same loss. Each (replica, tp rank) runs its
own pipeline over the mesh's "pp" group: stage s's tp rank r talks to stage s+1's tp rank r.

The split backward (B then W, runtime.backward) needs nothing more: the collectives of the
input path (all-gather and reduce-scatter, transposed) run in B; W computes each rank's
weight-gradient shard locally. The gradients of replicated (norm) weights come out
Partial (each rank's sum over its tokens); `full_tensor()` adds them up, and the optimizer's
first use does the same.
"""
from __future__ import annotations

import logging
from typing import Any

from torch import nn

__all__ = ["full_tensor", "planned_shapes", "settle_partial_grads", "tp_local_shape"]


def settle_partial_grads(params) -> None:
    """Give every gradient its parameter's placement: the Partial gradients of replicated
    (norm) weights are summed over the tp group here, once, rather than inside every
    optimizer operation that reads them. FSDP2 does the same for the chunks it shards."""
    from torch.distributed.tensor import DTensor  # DTensor takes 0.4 s to import: loaded only for a tensor-parallel run

    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def tp_local_shape(param) -> tuple[int, ...]:
    """The shape of the share of `param` one tensor-parallel rank holds: its full shape with
    each dimension the "tp" mesh dim shards divided by t (a parameter FSDP2 also shards over
    "dp" counts whole on that dim: the memory model applies the dp sharding itself)."""
    from torch.distributed.tensor import DTensor, Shard  # DTensor takes 0.4 s to import: loaded only for a tensor-parallel run

    shape = list(param.shape)
    if not isinstance(param, DTensor):
        return tuple(shape)
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    for dim, placement in enumerate(param.placements):
        if dim < len(names) and names[dim] == "tp" and isinstance(placement, Shard):
            shape[placement.dim] = -(-shape[placement.dim] // mesh.size(dim))
    return tuple(shape)


def full_tensor(tensor):
    """A DTensor gathered whole (tensor-parallel and FSDP2 shards, Partial sums added); a plain
    tensor as is. A (dp, tp)-sharded DTensor takes two all-gathers, which torch warns about
    once per tensor: expected here (--verify, checkpoints), so the warning is held back."""
    if not hasattr(tensor, "full_tensor"):
        return tensor
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return tensor.full_tensor()
    finally:
        logger.setLevel(level)


def planned_shapes(stage: nn.Module, plan: Any, tp: int) -> list[tuple[int, ...]]:
    """The shapes of one tp rank's share of a whole (not yet split) stage's trainable
    parameters, in `parameters()` order, as `models.tp_plan.parallelize_stage` would split them: a
    column-wise Linear's weight and bias by rows, a row-wise Linear's weight by columns (its
    bias whole), a row-wise Embedding by rows; the rest (norms) whole. For predictions made
    in one process (`train --dry-run`)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # DTensor takes 0.4 s to import: loaded only for a tensor-parallel run

    split: dict[int, int] = {}  # id(parameter) -> the dim split by tp

    def mark(root: nn.Module, styles) -> None:
        for path, style in styles.items():
            module = root.get_submodule(path)
            embedding = isinstance(module, nn.Embedding)
            if isinstance(style, ColwiseParallel):
                dims = {"weight": 1 if embedding else 0, "bias": 0}
            elif isinstance(style, RowwiseParallel):
                dims = {"weight": 0 if embedding else 1}
            else:
                continue
            for name, dim in dims.items():
                param = getattr(module, name, None)
                if param is not None:
                    split[id(param)] = dim

    for _, block in stage.block_items():
        mark(block, plan.block)
    if stage.is_first:
        mark(stage, plan.first)
    if stage.is_last:
        mark(stage, plan.last)
    shapes = []
    for param in stage.parameters():
        if not param.requires_grad:
            continue
        shape = list(param.shape)
        if id(param) in split:
            shape[split[id(param)]] //= tp
        shapes.append(tuple(shape))
    return shapes
