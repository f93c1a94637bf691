"""A model's tensor-parallel plan applied to one of its stages, by torch's DTensor
(`parallelize_module`); `runtime.tensor_parallel` says how the sharded stage then runs."""
from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["parallelize_stage"]


def parallelize_stage(stage: nn.Module, plan: Any, tp_mesh) -> nn.Module:
    """Shard `stage` (a `Stage`) over `tp_mesh` in place by `plan` (a
    `tp_plan.TPPlan`), and make its input and output the local token shard; returns it."""
    from torch.distributed.tensor import Shard  # DTensor takes 0.4 s to import: loaded only for a tensor-parallel run
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    if getattr(stage, "tp_mesh", None) is not None:
        raise ValueError(f"stage {stage.index} is already tensor-parallel: parallelize each stage once")
    for _, block in stage.block_items():
        parallelize_module(block, tp_mesh, dict(plan.block))
    if stage.is_first:
        parallelize_module(stage, tp_mesh, dict(plan.first))
    else:  # the received token shard, as the DTensor the blocks take
        parallelize_module(stage, tp_mesh, PrepareModuleInput(input_layouts=(Shard(1),),
                                                              desired_input_layouts=(Shard(1),)))
    if stage.is_last:
        parallelize_module(stage, tp_mesh, dict(plan.last))
    else:  # the local token shard is what is sent
        parallelize_module(stage, tp_mesh, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Shard(1),
                                                               use_local_output=True))
    stage.tp_mesh = tp_mesh
    return stage
