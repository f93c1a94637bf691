"""What one compute action does to tensors: real modules (`ModuleCompute`).

The executor owns order, communication and timing; a compute object owns the passes.
`emulate.EmulatedCompute` has the same methods and sleeps instead.

Per (stage, microbatch) the forward returns a `Unit` that the backward passes consume:
    forward        F: run the stage (and, on the last stage, the loss divided by m)
    input_grad     B: gradient of the stage input; keeps what W needs (backward.py)
    weight_grad    W: parameter gradients, accumulated into `.grad`
    full_backward  BW: both at once
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from .backward import WeightGradWork, fused_backward, input_backward
from .memory import SavedTensorTracker

__all__ = ["Unit", "ModuleCompute"]


@dataclass
class Unit:
    """State of one (stage, microbatch) between its passes."""

    inp: torch.Tensor | None
    root: torch.Tensor | None  # stage output, or the scaled loss on the last stage
    loss: torch.Tensor | None = None  # unscaled loss (last stage)
    work: WeightGradWork | None = None


class ModuleCompute:
    """Runs stage modules. The last stage's loss is divided by m, so that the gradients
    summed over the m microbatches are those of the mean loss."""

    def __init__(
        self,
        modules: Mapping[int, torch.nn.Module],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        last_stage: int,
        m: int,
        tracker: SavedTensorTracker,
    ) -> None:
        self.modules = modules
        self.loss_fn = loss_fn
        self.last_stage = last_stage
        self.m = m
        self.tracker = tracker
        self._params = {s: [p for p in mod.parameters() if p.requires_grad] for s, mod in modules.items()}

    def forward(self, stage: int, x: torch.Tensor, target: torch.Tensor | None) -> tuple[torch.Tensor | None, Unit]:
        """Returns (tensor for the next stage or None on the last stage, unit state)."""
        if stage > 0 and x.is_floating_point():
            x.requires_grad_(True)
        with self.tracker.saving():
            out = self.modules[stage](x)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"stage {stage} returned {type(out).__name__}; a stage module must return one tensor")
            if stage != self.last_stage:
                return out.detach(), Unit(x, out)
            loss = self.loss_fn(out, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(
                f"loss_fn returned {getattr(loss, 'shape', type(loss).__name__)}; it must return a scalar tensor "
                "(reduce with mean)"
            )
        return None, Unit(x, loss / self.m, loss.detach())

    def input_grad(self, stage: int, unit: Unit, grad: torch.Tensor | None) -> torch.Tensor | None:
        inp = unit.inp if stage > 0 else None
        dx, unit.work = input_backward(unit.root, grad, inp, self._params[stage])
        unit.root = None  # frees the graph above the join nodes
        unit.inp = None
        return dx

    def weight_grad(self, stage: int, unit: Unit) -> None:
        if unit.work is not None:
            unit.work.run()
        unit.work = None

    def full_backward(self, stage: int, unit: Unit, grad: torch.Tensor | None) -> torch.Tensor | None:
        inp = unit.inp if stage > 0 else None
        dx = fused_backward(unit.root, grad, inp)
        unit.root = unit.inp = None
        return dx
