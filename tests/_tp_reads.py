"""A worker for tests/test_hf_weights.py: build stage 0 of a Hugging Face directory's model on
a tensor-parallel mesh of the spawned ranks, recording what it reads from the safetensors."""
from __future__ import annotations


class RecordingWeights:
    """A WeightSource that records every (name, region) read from the one it wraps."""

    def __init__(self, inner) -> None:
        self.inner, self.reads = inner, []

    def shape(self, name):
        return self.inner.shape(name)

    def read(self, name, shape, region=None):
        self.reads.append((name, None if region is None else tuple((r.start, r.stop) for r in region)))
        return self.inner.read(name, shape, region)


def read_as_tp_rank(ctx, directory: str, num_stages: int, stage: int):
    """(the reads of this rank, its shard of every parameter by name) for `stage` under tp = world size."""
    import dataclasses

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from pipeblocks.models import build_stages
    from pipeblocks.models.hf import hf_spec

    spec = hf_spec(directory)
    recording = RecordingWeights(spec.weights)
    spec = dataclasses.replace(spec, weights=recording)
    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("tp",))
    (built,) = build_stages(spec, num_stages=num_stages, stages=[stage], dtype=torch.float64, tp_mesh=mesh)
    local = {name: getattr(p, "to_local", lambda p=p: p)().detach().clone() for name, p in built.named_parameters()}
    return recording.reads, local
