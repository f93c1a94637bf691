"""What one compute action does to tensors: real modules (`ModuleCompute`).

The executor owns order, communication and timing; a compute object owns the passes.
`emulate.EmulatedCompute` has the same methods and sleeps instead.

Per (stage, microbatch[, sequence chunk]) the forward returns a `Unit` that the backward
passes consume:
    forward        F: run the stage (and, on the last stage, the loss divided by m; for a
                   sequence chunk also weighted by length/total, see sequence.py)
    input_grad     B: gradient of the stage input; keeps what W needs (backward.py)
    weight_grad    W: parameter gradients, accumulated into `.grad`
    full_backward  BW: both at once

A (stage, microbatch) whose forward is recomputed (a RECOMPUTE op in the Program) runs F
as `forward(..., keep=False)`: without autograd, keeping only the stage input (counted
as a saved activation) and the random-number state; `recompute` then re-runs the
forward with autograd from that input and state just before the backward, so the graph
B and W use is the one a plain forward would have built, bit for bit.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import torch

from .backward import WeightGradWork, fused_backward, input_backward
from .memory import SavedTensorTracker
from .sequence import KVCache, SequenceChunk

__all__ = ["Unit", "ModuleCompute", "RecomputeState"]


@dataclass
class Unit:
    """State of one (stage, microbatch) between its passes."""

    inp: torch.Tensor | None
    root: torch.Tensor | None  # stage output, or the scaled loss on the last stage
    loss: torch.Tensor | None = None  # unscaled loss (last stage)
    work: WeightGradWork | None = None
    chunk: SequenceChunk | None = None  # with sequence chunks: which one
    leaves: tuple[torch.Tensor, ...] = ()  # earlier chunks' K/V leaves this unit attended over
    kept: RecomputeState | None = None  # a forward run without its graph: what recomputing needs


@dataclass
class RecomputeState:
    """What a forward run without autograd keeps for its recomputation."""

    target: torch.Tensor | None  # the loss target on the last stage
    rng: tuple[torch.Tensor, torch.Tensor | None]  # CPU and accelerator generator states at F
    handle: object | None = None  # the tracker's count of the kept input (a saved activation)


class ModuleCompute:
    """Runs stage modules. The last stage's loss is divided by m, so that the gradients
    summed over the m microbatches are those of the mean loss. With sequence chunks the
    loss of a chunk (a mean over its tokens) is also weighted by length/total: the sum
    over a microbatch's chunks is then the mean over its whole sequence."""

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
        self.kv_cache = KVCache()

    def use_parameters(self, stage: int, params: list[torch.nn.Parameter]) -> None:
        """The parameters B differentiates for `stage` from now on (FSDP2 swaps in the gathered
        ones when a sharded chunk is unsharded)."""
        self._params[stage] = params

    def forward(
        self, stage: int, x: torch.Tensor, target: torch.Tensor | None, chunk: SequenceChunk | None = None,
        *, keep: bool = True,
    ) -> tuple[torch.Tensor | None, Unit]:
        """Returns (tensor for the next stage or None on the last stage, unit state).
        keep=False: run without autograd, for a unit that `recompute` rebuilds later."""
        if not keep:
            if chunk is not None:
                raise ValueError(
                    f"stage {stage}: recomputing a sequence chunk is not supported (its K/V would be appended "
                    "twice); drop --recompute or --seq-chunks"
                )
            kept = RecomputeState(target, _rng_state(x.device), self.tracker.hold(x))
            with torch.no_grad():
                out, unit = self._forward(stage, x, target, None)
            unit.kept, unit.root = kept, None
            return out, unit
        return self._forward(stage, x, target, chunk)

    def recompute(self, stage: int, unit: Unit) -> None:
        """Re-run the forward of `unit` with autograd, from its kept input and random state."""
        kept = unit.kept
        if kept is None:
            raise RuntimeError(f"stage {stage}: recompute of a unit whose forward kept its graph")
        with _rng_restored(kept.rng, unit.inp.device):
            _, fresh = self._forward(stage, unit.inp, kept.target, None)
        unit.root, unit.kept = fresh.root, None
        # dropped after the graph saved the input again: one storage, counted once throughout
        kept.handle = None

    def _forward(
        self, stage: int, x: torch.Tensor, target: torch.Tensor | None, chunk: SequenceChunk | None
    ) -> tuple[torch.Tensor | None, Unit]:
        if stage > 0 and x.is_floating_point():
            x.requires_grad_(True)
        if chunk is not None:
            chunk = replace(chunk, cache=self.kv_cache)
            self.kv_cache.take_used()
        with self.tracker.saving():
            out = self.modules[stage](x) if chunk is None else self.modules[stage](x, chunk=chunk)
            leaves = self.kv_cache.take_used() if chunk is not None else ()
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"stage {stage} returned {type(out).__name__}; a stage module must return one tensor")
            if stage != self.last_stage:
                return out.detach(), Unit(x, out, chunk=chunk, leaves=leaves)
            loss = self.loss_fn(out, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(
                f"loss_fn returned {getattr(loss, 'shape', type(loss).__name__)}; it must return a scalar tensor "
                "(reduce with mean)"
            )
        if chunk is not None:
            loss = loss * (chunk.length / chunk.total)
        return None, Unit(x, loss / self.m, loss.detach(), chunk=chunk, leaves=leaves)

    def input_grad(self, stage: int, unit: Unit, grad: torch.Tensor | None) -> torch.Tensor | None:
        inp = unit.inp if stage > 0 else None
        dx, unit.work = input_backward(unit.root, grad, inp, self._params[stage], unit.leaves)
        unit.root = None  # frees the graph above the join nodes
        unit.inp = None
        self._backward_done(unit)
        return dx

    def weight_grad(self, stage: int, unit: Unit) -> None:
        if unit.work is not None:
            unit.work.run()
        unit.work = None

    def full_backward(self, stage: int, unit: Unit, grad: torch.Tensor | None) -> torch.Tensor | None:
        inp = unit.inp if stage > 0 else None
        dx = fused_backward(unit.root, grad, inp)
        unit.root = unit.inp = None
        self._backward_done(unit)
        return dx

    def _backward_done(self, unit: Unit) -> None:
        """The unit's K/V leaves have their gradient; chunk 0 is the microbatch's last backward."""
        unit.leaves = ()
        if unit.chunk is not None and unit.chunk.index == 0:
            self.kv_cache.release(unit.chunk.stage, unit.chunk.microbatch)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state and, for an accelerator tensor, its device's."""
    module = None if device.type == "cpu" else getattr(torch, device.type, None)
    accelerator = module.get_rng_state(device) if module is not None and hasattr(module, "get_rng_state") else None
    return torch.get_rng_state(), accelerator


@contextlib.contextmanager
def _rng_restored(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device):
    """Run with the generators as they were at the forward (a module with dropout draws the
    same mask again), then put them back, so the recomputation consumes no random numbers."""
    now = _rng_state(device)
    cpu, accelerator = state
    torch.set_rng_state(cpu)
    if accelerator is not None:
        getattr(torch, device.type).set_rng_state(accelerator, device)
    try:
        yield
    finally:
        torch.set_rng_state(now[0])
        if now[1] is not None:
            getattr(torch, device.type).set_rng_state(now[1], device)
