"""Build a model's stages, or the whole model, from its `ModelSpec`: one path for every model.

    >>> spec = llama_spec(LlamaConfig(layers=8, kv_heads=2))        # or gpt_spec, hf_spec(DIR), a user's
    >>> mine = build_stages(spec, seed=0, num_stages=4, stages=(0, 3))    # one V rank of p=2: only these
    >>> whole = build_model(spec, seed=0)                                  # the one-process reference
    >>> stages = split_stages(spec, whole, 4)                              # every stage, sharing its parameters

`build_stages` builds only the stages asked (`splitter.allocate_stages`), with the weights
the whole model of the same seed has (`spec.init(seed)`), or with the spec's pretrained
weights, of which it reads only those stages' tensors. With `tp_mesh` every stage is made
tensor-parallel by the spec's plan while still on the meta device, and each rank then
fills (and, from safetensors, reads) only its shard of every parameter.

A `GPTConfig` or a `LlamaConfig` stands for the built-in model of that config (`spec_of`).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from .config import GPTConfig
from .gpt import gpt_spec
from .layout import block_ranges
from .llama import llama_spec
from .llama_config import LlamaConfig
from .spec import ModelSpec
from .splitter import allocate_stages, default_dtype, skeleton_stage, split_model
from .stage import Stage
from .tp_plan import parallelize_stage

__all__ = ["build_model", "build_stages", "check_weights", "spec_of", "split_stages", "stage_parameter_shapes"]


def spec_of(model: Any) -> ModelSpec:
    """The spec `model` stands for: a ModelSpec itself, or the built-in model of a GPTConfig / LlamaConfig."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, GPTConfig):
        return gpt_spec(model)
    if isinstance(model, LlamaConfig):
        return llama_spec(model)
    raise TypeError(f"expected a ModelSpec (or a GPTConfig / LlamaConfig of a built-in model), got {type(model).__name__}")


def build_stages(
    model: Any,
    *,
    seed: int = 0,
    num_stages: int,
    stages: Sequence[int],
    device: torch.device | str | None = None,
    counts: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    tp_mesh: Any = None,
) -> list[Stage]:
    """Only the listed stages (global indices) of `model` (a spec or a built-in config), on
    `device`, in `dtype` (default: the model's own). tp_mesh: shard them over this
    tensor-parallel mesh by the spec's plan, each rank filling only its shards."""
    spec = spec_of(model)
    block_ranges(spec.shape.layers, num_stages, counts)  # the sizes' errors before anything is built
    prepare = None
    if tp_mesh is not None:
        plan = tp_plan_of(spec)
        prepare = lambda stage: parallelize_stage(stage, plan, tp_mesh)  # noqa: E731
    source = {"weights": spec.weights} if spec.weights is not None else {"init": spec.init(seed)}
    return allocate_stages(spec.build, spec.layout, num_stages=num_stages, stages=stages, device=device,
                           adapter=spec.adapter, counts=counts, dtype=dtype, prepare=prepare, **source)


def tp_plan_of(spec: ModelSpec):
    """The spec's tensor-parallel plan; a spec without one is refused, named."""
    if spec.tp_plan is None:
        raise ValueError(f"model {spec.name!r} has no tensor-parallel plan (ModelSpec.tp_plan is None): drop --tp, or "
                         "give the spec a tp_plan (docs/your-model.md)")
    return spec.tp_plan()


def build_model(model: Any, *, seed: int = 0, dtype: torch.dtype | None = None) -> nn.Module:
    """The whole model, with the weights its stages get (`spec.init(seed)`, or the pretrained
    weights): what one process trains as the reference of `--verify`."""
    spec = spec_of(model)
    with default_dtype(dtype):
        whole = spec.build()
    if dtype is not None and any(p.is_floating_point() and p.dtype != dtype for p in whole.parameters()):
        whole = whole.to(dtype)
    fill = spec.init(seed) if spec.weights is None else None
    with torch.no_grad():
        for name, param in whole.named_parameters():  # a tied weight once, by the embedding's name
            if fill is not None:
                fill(name, param)
            else:
                param.copy_(spec.weights.read(name, tuple(param.shape)))
    return whole


def split_stages(model: Any, whole: nn.Module, num_stages: int, *, counts: Sequence[int] | None = None) -> list[Stage]:
    """Every stage of `whole` (from `build_model`), sharing its parameters."""
    spec = spec_of(model)
    return split_model(whole, spec.layout, num_stages, adapter=spec.adapter, counts=counts)


def stage_parameter_shapes(model: Any, num_stages: int, stage: int) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the parameters stage `stage` holds, a tied head's copy left out (it is
    the embedding's weight), read off a skeleton on the meta device: nothing is allocated."""
    built = skeleton_stage(spec_of(model), num_stages, stage)
    copies = {pair.last for pair in built.tied}
    return {name: tuple(p.shape) for name, p in built.named_parameters() if name not in copies}


def check_weights(model: Any) -> None:
    """A pretrained spec's weights hold every parameter the model has, in its shape (read off
    the files' headers and a meta skeleton: nothing is loaded); the first miss is a ValueError
    naming the tensor (and both shapes). A spec without weights checks nothing."""
    spec = spec_of(model)
    if spec.weights is None or not hasattr(spec.weights, "shape"):
        return
    whole = skeleton_stage(spec, 1, 0)
    for name, param in whole.named_parameters():  # a tied copy once, by the embedding's name
        stored = spec.weights.shape(name)
        if stored != tuple(param.shape):
            raise ValueError(f"tensor {name} has shape {list(stored)} in the weights of {spec.name!r}, but the model "
                             f"(its config.json) expects {list(param.shape)}: the weights and config.json disagree")
