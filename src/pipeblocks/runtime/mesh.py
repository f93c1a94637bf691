"""The device mesh: pipeline ranks times data-parallel replicas.

    mesh = init_mesh(pp=2, dp=2, device=ctx.device)   # world size must be 4
    runner = PipelineRunner(schedule, stages, loss_fn, group=mesh.pp_group, ...)

The mesh is `torch.distributed.device_mesh.init_device_mesh` with named dims ("pp", "dp")
(a "tp" dim joins later, innermost). "pp" is the outer dim, so global rank
= pp_rank * dp + dp_rank: the d replicas of one pipeline rank sit next to each other (on
one machine, when a machine holds them), where the per-step DP collectives are heaviest.

A pipeline replica is one "pp" group: its pipeline rank is the rank inside that group,
and point-to-point transfers go through that group (the runtime maps a pipeline rank to a
global rank through the group, never assuming they are equal). DP collectives (gradient
reduction, parameter gather) run on the "dp" group of the pipeline rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["PipelineMesh", "check_world_size", "init_mesh"]

DIMS = ("pp", "dp")


def check_world_size(pp: int, dp: int, world_size: int) -> None:
    """Raise ValueError unless pp x dp processes make the world."""
    for name, value in (("pp", pp), ("dp", dp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if pp * dp != world_size:
        raise ValueError(
            f"the mesh needs p x d = {pp} x {dp} = {pp * dp} processes but the world has {world_size}: "
            f"launch {pp * dp} processes (torchrun --nproc-per-node / --nnodes), or choose p and --dp whose "
            f"product is {world_size}"
        )


@dataclass(frozen=True)
class PipelineMesh:
    """This process's place in the (pp, dp) mesh.

    device_mesh: the torch DeviceMesh with dims ("pp", "dp").
    pp, dp: its shape.  pp_rank: the pipeline rank (rank in the pp group).
    dp_rank: the replica (rank in the dp group).
    """

    device_mesh: DeviceMesh
    pp: int
    dp: int
    pp_rank: int
    dp_rank: int

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("dp")

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.device_mesh["dp"]

    def global_rank(self, pp_rank: int, dp_rank: int | None = None) -> int:
        """The global rank of pipeline rank `pp_rank` in replica `dp_rank` (default: this one)."""
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        return int(self.device_mesh.mesh[pp_rank, dp_rank])


def init_mesh(pp: int, dp: int, device: torch.device | str) -> PipelineMesh:
    """Build the mesh over the initialised default process group (a collective: every rank calls it)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: launch with pipeblocks.runtime.launch.spawn(...) or torchrun "
            "and call init_from_env() first"
        )
    check_world_size(pp, dp, dist.get_world_size())
    device = torch.device(device)
    mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=DIMS)
    return PipelineMesh(mesh, pp, dp, mesh.get_local_rank("pp"), mesh.get_local_rank("dp"))
