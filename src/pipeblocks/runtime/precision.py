"""Mixed precision for the runtime: bf16 compute from fp32 master weights.

Two paths with the same arithmetic (`core.cost.precision` names the policy):

* Chunks that FSDP2 shards (zero2, zero3): FSDP2's own `MixedPrecisionPolicy(param_dtype=
  bfloat16, reduce_dtype=float32)` (`fsdp_policy`): the gathered parameters are bfloat16,
  gradients accumulate and are reduce-scattered in float32 into the float32 shards.
* Every other chunk (one replica, replicate, zero1): `ComputeCopies`. The modules keep their
  float32 parameters (the optimizer, the checkpoints and the DP all-reduce see only those).
  At the start of a step every parameter is cast once, `master.to(bfloat16)`, and the stage
  modules run through `torch.func.functional_call` with those copies. The cast is a node of
  the autograd graph that every microbatch of the step shares (it saves no tensor, so each
  microbatch's backward may pass through it): each microbatch's bfloat16 weight gradient
  flows back through it and is accumulated into the master's `.grad` in float32, by
  autograd itself, for the fused backward and for the split B/W backward alike. At the end
  of the step the copies are dropped.

    copies = ComputeCopies(stages, torch.bfloat16)          # stages: global index -> module
    runner = PipelineRunner(schedule, copies.stages, loss_fn, precision=copies)

Under tensor parallelism (`tensor_parallel.py`) the masters are DTensors and so are their
copies (`master.to(bfloat16)` casts the local shard); `functional_call` runs the parallel
styles' hooks with them, so the same two paths hold: ComputeCopies on the chunks FSDP2 does
not shard, FSDP2's policy on those it does (gathered over "dp", still sharded over "tp").

Why not FSDP2 everywhere: a replicated chunk would need an FSDP2 module over a one-rank
mesh per replica and its hooks on every pass; the cast copies are the same arithmetic in
a dozen lines and run without torch.distributed (the one-process reference of `--verify`
uses them too). Why not `torch.autocast`: it casts per op and keeps fp32 where it
chooses (norms, softmax), so activations would be of mixed dtypes and the copies of the
weights would be made again in every microbatch's forward.

Bytes per parameter held (float32 AdamW): master 4 + copy 2 (during the step) + gradient
4 + moments 8 = 18, as `core.cost.dp_model.PRECISIONS["bf16-mixed"]` prices it.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["CastStage", "ComputeCopies", "fsdp_policy", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `core.cost.precision` dtype name ("float32", "bfloat16", ...)."""
    return getattr(torch, name)


class CastStage(nn.Module):
    """A stage module run with its parameters' compute copies (`ComputeCopies`).

    Its parameters are the wrapped module's (the float32 masters); `forward` calls the
    wrapped module with the copies in their place. Attributes it does not have are read
    from the wrapped module (`index`, `layers`, `supports_sequence_chunks`, ...).
    """

    def __init__(self, module: nn.Module, copies: ComputeCopies, stage: int) -> None:
        super().__init__()
        self.module = module
        # a plain attribute, not a submodule: `copies` holds this stage among others
        object.__setattr__(self, "_copies", copies)
        self.stage = stage

    def forward(self, *args, chunk=None, **kwargs):
        if chunk is not None:
            kwargs["chunk"] = chunk
        return functional_call(self.module, self._copies.of(self.stage), args, kwargs, strict=False)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


class ComputeCopies:
    """The cast copies of some stages' parameters, made once per step.

    stages: global stage -> module with float32 (master) parameters.
    dtype: the compute dtype (torch.bfloat16).
    `stages` (the attribute): global stage -> `CastStage`, to give the runner.
    """

    def __init__(self, stages: Mapping[int, nn.Module], dtype: torch.dtype) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"compute dtype {dtype} is not a floating-point dtype")
        self.dtype = dtype
        self.modules = dict(stages)
        for stage, module in self.modules.items():
            for name, param in module.named_parameters():
                if param.is_floating_point() and param.element_size() < torch.tensor([], dtype=dtype).element_size():
                    raise ValueError(
                        f"stage {stage}: parameter {name} is {param.dtype}, narrower than the compute dtype {dtype}: "
                        "keep master weights in float32 (build the model in float32 for bf16-mixed)"
                    )
        self.stages = {s: CastStage(module, self, s) for s, module in self.modules.items()}
        self._copies: dict[int, dict[str, torch.Tensor]] = {}
        self.step_bytes = 0
        """bytes of the copies of the latest step (held from its start to its end)"""

    def begin_step(self) -> list[torch.Tensor]:
        """Cast every parameter (once per step); returns the copies (not activations: the
        runner's memory count excludes them)."""
        self._copies = {}
        with torch.enable_grad():
            for stage, module in self.modules.items():
                self._copies[stage] = {
                    name: param.to(self.dtype) if param.is_floating_point() else param
                    for name, param in module.named_parameters()
                }
        held = self.held()
        # a DTensor copy (tensor parallelism) holds its local shard
        self.step_bytes = sum(getattr(t, "_local_tensor", t).numel() * t.element_size() for t in held)
        return held

    def end_step(self) -> None:
        """Drop the copies: the step's graphs, which held them, are gone."""
        self._copies = {}

    def of(self, stage: int) -> dict[str, torch.Tensor]:
        copies = self._copies.get(stage)
        if copies is None:
            raise RuntimeError(
                f"stage {stage} ran outside a step: call ComputeCopies.begin_step() first (PipelineRunner does it "
                "when given precision=)"
            )
        return copies

    def held(self) -> list[torch.Tensor]:
        """The copies alive now."""
        return [t for copies in self._copies.values() for t in copies.values()]

    def __enter__(self) -> ComputeCopies:
        self.begin_step()
        return self

    def __exit__(self, *exc) -> None:
        self.end_step()


def fsdp_policy(compute: torch.dtype, reduce: torch.dtype = torch.float32):
    """FSDP2's policy for a sharded chunk: gather in `compute`, reduce in `reduce`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # FSDP2 loads DTensor (0.4 s): only for a sharded run

    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)
