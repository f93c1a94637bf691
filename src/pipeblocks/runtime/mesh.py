"""The device mesh: pipeline ranks times data-parallel replicas times tensor-parallel ranks.

    mesh = init_mesh(pp=2, dp=2, device=ctx.device)          # world size must be 4
    mesh = init_mesh(pp=2, dp=2, tp=2, device=ctx.device)    # world size must be 8
    runner = PipelineRunner(schedule, stages, loss_fn, group=mesh.pp_group, ...)

The mesh is `torch.distributed.device_mesh.init_device_mesh` with named dims ("pp", "dp",
"tp"), as torchtitan orders them: "pp" outermost, "tp" innermost, so global rank
= (pp_rank * dp + dp_rank) * tp + tp_rank. The t ranks of one tensor-parallel group sit
next to each other (on one machine's GPUs, where its per-layer collectives belong), then
the d replicas of one pipeline rank. With tp = 1 the mesh is the two-dim ("pp", "dp") mesh
(no "tp" groups are created).

A pipeline replica is one "pp" group: every (replica, tensor-parallel rank) pair runs its
own pipeline, whose stages hold that rank's shards; its pipeline rank is the rank inside
that group, and point-to-point transfers go through that group (the runtime maps a
pipeline rank to a global rank through the group, never assuming they are equal). DP
collectives (gradient reduction, parameter gather) run on the "dp" group, tensor-parallel
ones (inside DTensor) on the "tp" group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["PipelineMesh", "check_world_size", "init_mesh"]

DIMS = ("pp", "dp", "tp")


def check_world_size(pp: int, dp: int, world_size: int, tp: int = 1) -> None:
    """Raise ValueError unless pp x dp x tp processes make the world."""
    for name, value in (("pp", pp), ("dp", dp), ("tp", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if pp * dp * tp != world_size:
        shape = f"p x d = {pp} x {dp}" if tp == 1 else f"p x d x t = {pp} x {dp} x {tp}"
        raise ValueError(
            f"the mesh needs {shape} = {pp * dp * tp} processes but the world has {world_size}: "
            f"launch {pp * dp * tp} processes (torchrun --nproc-per-node / --nnodes), or choose p, --dp and --tp "
            f"whose product is {world_size}"
        )


@dataclass(frozen=True)
class PipelineMesh:
    """This process's place in the (pp, dp, tp) mesh.

    device_mesh: the torch DeviceMesh with dims ("pp", "dp"), and "tp" when tp > 1.
    pp, dp, tp: its shape.  pp_rank: the pipeline rank (rank in the pp group).
    dp_rank: the replica (rank in the dp group).  tp_rank: the rank in the tp group.
    """

    device_mesh: DeviceMesh
    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    tp: int = 1
    tp_rank: int = 0

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("dp")

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.device_mesh["dp"]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The one-dim "tp" mesh the stages' DTensors live on (None when tp = 1)."""
        return self.device_mesh["tp"] if self.tp > 1 else None

    def global_rank(self, pp_rank: int, dp_rank: int | None = None, tp_rank: int | None = None) -> int:
        """The global rank of pipeline rank `pp_rank` in replica `dp_rank` and tensor-parallel
        rank `tp_rank` (default: this process's)."""
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        if self.tp == 1:
            return int(self.device_mesh.mesh[pp_rank, dp_rank])
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        return int(self.device_mesh.mesh[pp_rank, dp_rank, tp_rank])


def init_mesh(pp: int, dp: int, device: torch.device | str, tp: int = 1) -> PipelineMesh:
    """Build the mesh over the initialised default process group (a collective: every rank calls it)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: launch with pipeblocks.runtime.launch.spawn(...) or torchrun "
            "and call init_from_env() first"
        )
    check_world_size(pp, dp, dist.get_world_size(), tp)
    device = torch.device(device)
    if tp == 1:
        mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=DIMS[:2])
        return PipelineMesh(mesh, pp, dp, mesh.get_local_rank("pp"), mesh.get_local_rank("dp"))
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=DIMS)
    return PipelineMesh(mesh, pp, dp, mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), tp,
                        mesh.get_local_rank("tp"))
