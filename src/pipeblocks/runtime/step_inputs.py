"""A step's inputs, targets and side inputs as the runner takes them: split into the m
microbatches of the schedule and moved to the rank's device.

    xs = microbatches(inputs, m, "inputs")              # a tensor or dict: split along dim 0
    xs = microbatches([x0, x1], 2, "inputs")            # or a list (tuple) of the m microbatches
    side = side_microbatches({"mask": mask}, m, device)  # per microbatch, name -> tensor
    x = to_device(xs[0], device)                        # a tensor, or a tuple or dict of tensors
    side_text(specs)                                    # side-input specs, for messages

Each microbatch split from a batch owns its storage (a clone), so what autograd saves of
it is freed with it. Side inputs are never sent between ranks; every rank gives the same.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .shapes import TensorSpec, flatten

__all__ = ["microbatches", "side_microbatches", "side_text", "to_device"]


def microbatches(value, m: int, name: str) -> list:
    """m microbatches: of a tensor or a dict of tensors (split along dim 0), or as given (a
    list or tuple of m)."""
    if value is None:
        raise ValueError(f"{name} are required on this rank: it holds the stage that consumes them")
    if isinstance(value, (torch.Tensor, Mapping)):
        layout, leaves = flatten(value, name)
        for leaf in leaves:
            if leaf.dim() == 0 or leaf.shape[0] % m:
                raise ValueError(
                    f"{name} has leading dimension {leaf.shape[0] if leaf.dim() else 0}, not divisible by m={m}: "
                    f"give a batch size that is a multiple of {m}, or a list of {m} microbatches"
                )
        # clones: each microbatch owns its storage, so what autograd saves of it is freed with it
        parts = [[part.clone() for part in leaf.chunk(m)] for leaf in leaves]
        return [layout.build([p[i] for p in parts]) for i in range(m)]
    value = list(value)
    if len(value) != m:
        raise ValueError(f"{name} has {len(value)} microbatches but the schedule has m={m}: give exactly {m}")
    return value


def side_microbatches(side, m: int, device: torch.device) -> list[dict[str, torch.Tensor]] | None:
    """Per microbatch, name -> tensor (on `device`); None without side inputs."""
    if not side:
        return None
    if not isinstance(side, Mapping):
        raise TypeError(f"side_inputs must be a dict name -> tensor, got {type(side).__name__}")
    per_name = {}
    for name, value in side.items():
        if not isinstance(name, str) or name == "chunk":
            raise ValueError(f"side input name {name!r}: names are str keywords of the stages' forward, not 'chunk'")
        parts = microbatches(value, m, f"side input {name!r}")
        bad = [type(t).__name__ for t in parts if not isinstance(t, torch.Tensor)]
        if bad:
            raise TypeError(f"side input {name!r} has a microbatch of type {bad[0]}: give tensors")
        per_name[name] = [t.to(device) for t in parts]
    return [{name: parts[i] for name, parts in per_name.items()} for i in range(m)]


def side_text(specs: list[dict[str, TensorSpec]]) -> str:
    if not specs:
        return "(none)"
    return str([{name: str(spec) for name, spec in mb.items()} for mb in specs])


def to_device(value, device: torch.device):
    """An input or target (a tensor, or a tuple or dict of tensors) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    layout, leaves = flatten(value, "an input")
    return layout.build([t.to(device) for t in leaves])
