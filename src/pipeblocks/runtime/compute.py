"""What one compute action does to tensors: real modules (`ModuleCompute`).

The executor owns order, communication and timing; a compute object owns the passes.
`emulate.EmulatedCompute` has the same methods and sleeps instead.

Activations are tensors, or tuples or dicts of tensors (shapes.py); a stage gets its
input as `shapes.call_stage` passes it, with this microbatch's side inputs as keyword
arguments. The gradient handed to a backward, and the one it returns, has the form of
shapes.py: a tensor for an activation that is one floating tensor, else a tuple with one
tensor per floating leaf. Every floating leaf of a stage input (stage > 0) requires grad;
the floating outputs that require grad are the roots of its backward, each with its
received gradient.

Per (stage, microbatch[, sequence chunk]) the forward returns a `Unit` that the backward
passes consume:
    forward        F: run the stage (and, on the last stage, the loss divided by m; for a
                   sequence chunk also weighted by length/total, see sequence.py)
    input_grad     B: gradient of the stage input; keeps what W needs (backward.py)
    weight_grad    W: parameter gradients, accumulated into `.grad`
    full_backward  BW: both at once

An overlapped pair (one unit's forward and another's fused backward, `program.Overlap`)
runs through `overlapped` when the two stage modules share a class that defines
DualPipe's hook (`overlap_hook` says whether they do)::

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0,
                                    module1, loss1, outputs1, output_grads1):
        # forward module0 on inputs0 (criterion0(outputs0, labels0) on the last stage),
        # and backward of module1: loss1.backward() on the last stage, else
        # torch.autograd.backward(outputs1, output_grads1), interleaved as the model can
        return outputs0, loss0

A (stage, microbatch) whose forward is recomputed (a RECOMPUTE op in the Program) runs F
as `forward(..., keep=False)`: without autograd, keeping only the stage input (every leaf
counted as a saved activation), its side inputs and the random-number state; `recompute`
then re-runs the forward with autograd from that input and state just before the
backward, so the graph B and W use is the one a plain forward would have built, bit for
bit.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch

from .backward import PartitionCache, WeightGradWork, fused_backward, input_backward
from .memory import SavedTensorTracker
from .sequence import KVCache, SequenceChunk
from .shapes import call_stage, flatten, floating_leaves, leaves_of

__all__ = ["Unit", "ModuleCompute", "RecomputeState"]


@dataclass
class Unit:
    """State of one (stage, microbatch) between its passes."""

    inp: Any  # the stage input (an activation), None once its backward ran
    root: Any  # stage output (an activation), or the scaled loss on the last stage
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
    side: Mapping[str, Any] | None = None  # the microbatch's side inputs


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
        loss_stages: frozenset[int] | None = None,
        first_takes_grad: bool = False,
    ) -> None:
        self.modules = modules
        # vocabulary parallelism: stage 0's input is the embedding output, whose gradient
        # its backward returns (every stage then takes and returns a gradient)
        self.first_grad = 0 if first_takes_grad else 1
        self.loss_fn = loss_fn
        self.last_stage = last_stage
        # the stages that end in the loss: the last, or each chain's last (DualPipe)
        self.loss_stages = loss_stages if loss_stages is not None else frozenset((last_stage,))
        self.m = m
        self.tracker = tracker
        self._params = {s: [p for p in mod.parameters() if p.requires_grad] for s, mod in modules.items()}
        # one B/W partition per stage, reused by every microbatch whose graph has its structure
        self.partitions = {s: PartitionCache() for s in modules}
        self.kv_cache = KVCache()

    def use_parameters(self, stage: int, params: list[torch.nn.Parameter]) -> None:
        """The parameters B differentiates for `stage` from now on (FSDP2 swaps in the gathered
        ones when a sharded chunk is unsharded)."""
        self._params[stage] = params

    def forward(
        self, stage: int, x: Any, target: torch.Tensor | None, chunk: SequenceChunk | None = None,
        *, keep: bool = True, side: Mapping[str, Any] | None = None,
    ) -> tuple[Any, Unit]:
        """Returns (activation for the next stage or None on the last stage, unit state).
        side: this microbatch's side inputs, keyword arguments of the stage's forward.
        keep=False: run without autograd, for a unit that `recompute` rebuilds later."""
        if not keep:
            if chunk is not None:
                raise ValueError(
                    f"stage {stage}: recomputing a sequence chunk is not supported (its K/V would be appended "
                    "twice); drop --recompute or --seq-chunks"
                )
            leaves = leaves_of(x)
            held = self.tracker.hold(x) if isinstance(x, torch.Tensor) else tuple(self.tracker.hold(t) for t in leaves)
            kept = RecomputeState(target, _rng_state(leaves[0].device), held, side)
            with torch.no_grad():
                out, unit = self._forward(stage, x, target, None, side)
            unit.kept, unit.root = kept, None
            return out, unit
        return self._forward(stage, x, target, chunk, side)

    def overlap_hook(self, forward_stage: int, backward_stage: int) -> Callable | None:
        """The stage class's `overlapped_forward_backward` when both stage modules have one
        class that defines it (DualPipe's rule), else None: the pair runs part by part."""
        first, second = self.modules[forward_stage], self.modules[backward_stage]
        hook = getattr(type(first), "overlapped_forward_backward", None)
        return hook if hook is not None and type(first) is type(second) else None

    def overlapped(
        self, stage: int, x: Any, target: torch.Tensor | None, backward_stage: int, unit: Unit, grad: Any,
        *, side: Mapping[str, Any] | None = None, keep: bool = True,
    ) -> tuple[Any, Unit, Any]:
        """Stage `stage`'s forward of `x` and `backward_stage`'s fused backward of `unit` with
        output gradient `grad`, through the modules' hook. Returns (activation for the next
        stage or None on the last stage, the forward's unit, the gradient of the backward
        stage's input)."""
        hook = self.overlap_hook(stage, backward_stage)
        if hook is None or side or not keep:
            raise ValueError(
                f"stages {stage} and {backward_stage}: the overlap hook runs plain stages (no side inputs, no "
                "recomputation)"
            )
        if stage >= self.first_grad:
            for leaf in floating_leaves(x):
                leaf.requires_grad_(True)
        roots, grads, inp = _backward_args(backward_stage, unit, grad, self.first_grad)
        last_backward = backward_stage in self.loss_stages
        criterion = (lambda out, labels: self.loss_fn(out, labels)) if stage in self.loss_stages else None
        module0, module1 = self.modules[stage], self.modules[backward_stage]
        with self.tracker.saving():
            outputs0, loss0 = hook(
                module0, x, criterion, target, module1,
                roots if last_backward else None, None if last_backward else roots, None if last_backward else grads,
            )
        inputs = [] if inp is None else [inp] if isinstance(inp, torch.Tensor) else list(inp)
        dxs = []
        for t in inputs:
            dx, t.grad = t.grad, None
            dxs.append(dx if dx is not None or not t.requires_grad else torch.zeros_like(t))
        dx = _input_gradient(backward_stage, unit.inp, dxs[0] if isinstance(inp, torch.Tensor) else dxs or None,
                             self.first_grad)
        unit.root = unit.inp = None
        self._backward_done(unit)
        if stage not in self.loss_stages:
            return _detached(outputs0, stage), Unit(x, outputs0), dx
        if not isinstance(loss0, torch.Tensor) or loss0.dim() != 0:
            raise ValueError(f"stage {stage}: the overlap hook returned loss {loss0!r}; it must be a scalar tensor")
        return None, Unit(x, loss0 / self.m, loss0.detach()), dx

    def recompute(self, stage: int, unit: Unit) -> None:
        """Re-run the forward of `unit` with autograd, from its kept input and random state."""
        kept = unit.kept
        if kept is None:
            raise RuntimeError(f"stage {stage}: recompute of a unit whose forward kept its graph")
        with _rng_restored(kept.rng, leaves_of(unit.inp)[0].device):
            _, fresh = self._forward(stage, unit.inp, kept.target, None, kept.side)
        unit.root, unit.kept = fresh.root, None
        # dropped after the graph saved the input again: one storage, counted once throughout
        kept.handle = None

    def _forward(
        self, stage: int, x: Any, target: torch.Tensor | None, chunk: SequenceChunk | None,
        side: Mapping[str, Any] | None = None,
    ) -> tuple[Any, Unit]:
        if stage >= self.first_grad:
            for leaf in floating_leaves(x):
                leaf.requires_grad_(True)
        if chunk is not None:
            chunk = replace(chunk, cache=self.kv_cache)
            self.kv_cache.take_used()
        with self.tracker.saving():
            out = call_stage(self.modules[stage], x, side, chunk)
            leaves = self.kv_cache.take_used() if chunk is not None else ()
            if stage not in self.loss_stages:
                return _detached(out, stage), Unit(x, out, chunk=chunk, leaves=leaves)
            loss = self.loss_fn(out, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(
                f"loss_fn returned {getattr(loss, 'shape', type(loss).__name__)}; it must return a scalar tensor "
                "(reduce with mean)"
            )
        if chunk is not None:
            loss = loss * (chunk.length / chunk.total)
        return None, Unit(x, loss / self.m, loss.detach(), chunk=chunk, leaves=leaves)

    def input_grad(self, stage: int, unit: Unit, grad: Any) -> Any:
        root, grad, inp = _backward_args(stage, unit, grad, self.first_grad)
        dx, unit.work = input_backward(root, grad, inp, self._params[stage], unit.leaves,
                                       partitions=self.partitions[stage])
        dx = _input_gradient(stage, unit.inp, dx, self.first_grad)
        unit.root = None  # frees the graph above the join nodes
        unit.inp = None
        self._backward_done(unit)
        return dx

    def weight_grad(self, stage: int, unit: Unit) -> None:
        if unit.work is not None:
            unit.work.run()
        unit.work = None

    def full_backward(self, stage: int, unit: Unit, grad: Any) -> Any:
        root, grad, inp = _backward_args(stage, unit, grad, self.first_grad)
        dx = _input_gradient(stage, unit.inp, fused_backward(root, grad, inp), self.first_grad)
        unit.root = unit.inp = None
        self._backward_done(unit)
        return dx

    def _backward_done(self, unit: Unit) -> None:
        """The unit's K/V leaves have their gradient; chunk 0 is the microbatch's last backward."""
        unit.leaves = ()
        if unit.chunk is not None and unit.chunk.index == 0:
            self.kv_cache.release(unit.chunk.stage, unit.chunk.microbatch)


def _detached(out: Any, stage: int) -> Any:
    """What the next stage gets: the output, cut from this stage's graph."""
    if isinstance(out, torch.Tensor):
        return out.detach()
    layout, leaves = flatten(out, f"stage {stage}'s output")
    return layout.build([t.detach() for t in leaves])


def _backward_args(stage: int, unit: Unit, grad: Any, first_grad: int = 1) -> tuple[Any, Any, Any]:
    """(roots, their gradients, inputs) for backward.py: the tensors themselves for a stage
    whose output and input are one floating tensor each (the loss is the root of the last
    stage), else lists: the floating outputs and their gradients, the floating inputs.
    first_grad: the first stage whose input takes a gradient (0 under vocabulary parallelism)."""
    root, inp = unit.root, unit.inp if stage >= first_grad else None
    if not (isinstance(root, torch.Tensor) and (grad is None or isinstance(grad, torch.Tensor))):
        root, grad = floating_leaves(root), leaves_of(grad)
        if len(root) != len(grad):
            raise ValueError(f"stage {stage}: {len(grad)} gradients for {len(root)} floating outputs")
    if inp is not None and not (isinstance(inp, torch.Tensor) and inp.is_floating_point()):
        inp = floating_leaves(inp) or None
    return root, grad, inp


def _input_gradient(stage: int, inp: Any, dx: Any, first_grad: int = 1) -> Any:
    """The gradient of the stage input in the form of shapes.py (None: the backward reached
    none of the input's floating leaves; on stage 0 always None, unless `first_grad` is 0)."""
    if stage < first_grad or isinstance(dx, torch.Tensor):
        return dx if stage >= first_grad else None
    if not floating_leaves(inp):
        return ()  # nothing to send back
    return None if dx is None else tuple(dx)


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
