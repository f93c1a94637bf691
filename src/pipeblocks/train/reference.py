"""The single-process reference that pipeline runs are checked against (`train --verify`).

    >>> loss, grads = reference_step(cfg, seed=0, inputs=x, targets=y, microbatches=8)
    >>> worst = compare_grads(pipeline_grads, grads)     # GradDiff(name, relative difference)

One process builds the whole GPT from the same seed, runs the step's m microbatches one
after another with loss/m each (the pipeline's per-step loss is the mean of its
microbatch losses), and keeps every parameter's gradient by name. The names are the ones
the stage modules use, so a pipeline's gradients compare one to one.

With gradient clipping the reference is synchronous clipping in one process:
`torch.nn.utils.clip_grad_norm_` over the whole model, then AdamW.

    >>> loss, clipped, params, norm = reference_update(cfg, seed=0, inputs=x, targets=y, microbatches=8,
    ...                                                lr=3e-3, max_norm=0.1)
    >>> losses = reference_losses(cfg, seed=0, batches=batches, microbatches=8, lr=3e-3, max_norm=0.1, skip={2})
"""
from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor

from ..models import GPT, GPTConfig, cross_entropy

__all__ = [
    "TOLERANCE",
    "GradDiff",
    "compare_grads",
    "reference_apply",
    "reference_losses",
    "reference_step",
    "reference_update",
    "relative_difference",
    "torch_threads",
]

TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
"""Largest relative difference `train --verify` (and `train --async MODE --verify`) accepts, by
dtype: every schedule computes the gradients of one process, up to the order of sums."""


class GradDiff(NamedTuple):
    name: str
    relative: float


def reference_step(
    cfg: GPTConfig, *, seed: int, inputs: Tensor, targets: Tensor, microbatches: int
) -> tuple[float, dict[str, Tensor]]:
    """(mean microbatch loss, gradient of every parameter by name) for one step."""
    if inputs.size(0) % microbatches:
        raise ValueError(f"a batch of {inputs.size(0)} does not split into {microbatches} equal microbatches")
    model = GPT(cfg, seed=seed)
    loss = _accumulate(model, inputs, targets, microbatches)
    return loss, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def reference_update(
    cfg: GPTConfig, *, seed: int, inputs: Tensor, targets: Tensor, microbatches: int, lr: float,
    max_norm: float | None,
) -> tuple[float, dict[str, Tensor], dict[str, Tensor], float]:
    """One step with synchronous clipping: (loss, clipped gradients, parameters after AdamW, global norm)."""
    model = GPT(cfg, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = _accumulate(model, inputs, targets, microbatches)
    norm = _clip(model, max_norm)
    optimizer.step()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, norm


def reference_apply(cfg: GPTConfig, *, seed: int, grads: Mapping[str, Tensor], lr: float) -> dict[str, Tensor]:
    """The parameters after one AdamW step from the seed's weights with the given gradients.

    `train --verify` checks the ranks' optimizer step with this, on the gradients the ranks
    used: AdamW's first step moves each weight by about lr * g / (|g| + eps), a sign of g
    for every gradient above eps, so two correct runs whose gradients differ by rounding
    (float32 sums in another order: microbatches, replicas, reduce-scatter) move a weight
    whose gradient is near zero by very different amounts. Those gradients are compared
    with the reference's own; the step is compared with the step the reference optimizer
    takes from the same gradients, which is well conditioned."""
    model = GPT(cfg, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for name, param in model.named_parameters():
        if name not in grads:
            raise ValueError(f"no gradient for parameter {name!r}: give the gradient of every parameter")
        param.grad = grads[name].to(dtype=param.dtype, device=param.device).clone()
    optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_losses(
    cfg: GPTConfig, *, seed: int, batches: Iterable[tuple[Tensor, Tensor]], microbatches: int, lr: float,
    max_norm: float | None = None, skip: Container[int] = (),
) -> list[float]:
    """Each step's loss over `batches`, clipping synchronously; the steps in `skip` (0-based) compute
    their loss but make no update, as a run without that batch's update."""
    model = GPT(cfg, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step, (inputs, targets) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        losses.append(_accumulate(model, inputs, targets, microbatches))
        if step not in skip:
            _clip(model, max_norm)
            optimizer.step()
    return losses


def _accumulate(model: GPT, inputs: Tensor, targets: Tensor, microbatches: int) -> float:
    total = 0.0
    for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
        loss = cross_entropy(model(x), y)
        (loss / microbatches).backward()
        total += loss.item()
    return total / microbatches


def _clip(model: GPT, max_norm: float | None) -> float:
    params = list(model.parameters())
    if max_norm is None:
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])).item()
    return torch.nn.utils.clip_grad_norm_(params, max_norm).item()


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with `threads` torch threads (a rank's count), then restore the caller's:
    matrix products round the same way as on the ranks."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def relative_difference(a: Tensor | float, b: Tensor | float) -> float:
    """max|a - b| / max|b| (absolute when b is all zero)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def compare_grads(got: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> GradDiff:
    """The parameter whose gradient differs most (relative), over all parameters."""
    if got.keys() != expected.keys():
        missing = sorted(expected.keys() - got.keys())
        extra = sorted(got.keys() - expected.keys())
        raise ValueError(f"pipeline gradients do not cover the model: missing {missing[:5]}, unexpected {extra[:5]}")
    worst = GradDiff("", 0.0)
    for name, grad in expected.items():
        if got[name] is None:
            return GradDiff(name, float("inf"))
        diff = relative_difference(got[name], grad)
        if diff > worst.relative or not worst.name:
            worst = GradDiff(name, diff)
    return worst
