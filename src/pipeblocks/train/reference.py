"""The single-process reference that pipeline runs are checked against (`train --verify`).

    >>> loss, grads = reference_step(cfg, seed=0, inputs=x, targets=y, microbatches=8)
    >>> worst = compare_grads(pipeline_grads, grads)     # GradDiff(name, relative difference)

One process builds the whole model from the same seed (`model`: the run's `ModelChoice`, a
`pipeblocks.models.ModelSpec`, or a built-in's GPTConfig / LlamaConfig), with its pretrained
weights where it has them, runs the step's m microbatches
one after another with loss/m each (the pipeline's per-step loss is the mean of its
microbatch losses), and keeps every parameter's gradient by name. The names are the ones
the stage modules use, so a pipeline's gradients compare one to one. Under bf16-mixed
(`precision=`) it computes as the ranks do: one bfloat16 copy of the weights for the step
(`runtime.precision.ComputeCopies`), the gradients accumulated in float32 into the float32
weights, the loss in float32.

With gradient clipping the reference is synchronous clipping in one process:
`torch.nn.utils.clip_grad_norm_` over the whole model, then AdamW.

    >>> loss, clipped, params, norm = reference_update(cfg, seed=0, inputs=x, targets=y, microbatches=8,
    ...                                                lr=3e-3, max_norm=0.1)
    >>> losses = reference_losses(cfg, seed=0, batches=batches, microbatches=8, lr=3e-3, max_norm=0.1, skip={2})
"""
from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor

from ..core.cost.precision import PrecisionPolicy
from ..models.build import build_model, spec_of
from ..models.spec import model_logits
from ..models.splitter import tied_pairs
from ..runtime.precision import ComputeCopies, torch_dtype
from .model_choice import ModelChoice

__all__ = [
    "TOLERANCE",
    "ROUNDING_NOISE_FACTOR",
    "TP_BF16_TOLERANCE",
    "whole_model",
    "GradDiff",
    "compare_grads",
    "excess_error",
    "in_float64",
    "reference_apply",
    "reference_losses",
    "reference_step",
    "reference_update",
    "relative_difference",
    "torch_threads",
]

TOLERANCE = {"fp64": 1e-10, "fp32": 1e-5, "bf16-mixed": 1e-2}
"""Largest relative difference `train --verify` (and `train --async MODE --verify`) accepts, by
precision: every schedule computes the gradients of one process, up to the order of sums.

Under bf16-mixed the one process computes each microbatch in bfloat16 as the ranks do
(the same weights' copy, the same operations, the float32 accumulation in microbatch
order), so a difference comes only from sums taken in another order: a matrix product
split differently among threads, or microbatch gradients added in another order into the
float32 sum. One such reordering moves a bfloat16 result by up to a rounding, 2^-8 = 3.9e-3
of its size, and the difference is measured against the largest element of each gradient
(`relative_difference`), so 1e-2 holds with room for two or three such roundings. Chunks
that FSDP2 shards (zero2, zero3) round once more: a split backward's W adds its bfloat16
gradient to the gathered parameter after FSDP2 has folded the microbatch's B into the
float32 sum, so consecutive W gradients meet in bfloat16 before they are folded. Measured
on CPU, the ranks and the reference with one thread each: 0 for llama with zb-v and v-half
at p = 2 (bit for bit); 2.2e-3 with zb-h1 and zb-v at p = 2 x dp = 2 under zero3 and zero2."""


TP_BF16_TOLERANCE = 3e-2
"""`train --verify`'s tolerance under bf16-mixed with tensor parallelism (tp > 1; fp64 and fp32
keep `TOLERANCE`). Tensor parallelism rounds more often, not in another order: a row-parallel
projection (attention out, MLP down) leaves a partial product on each tp rank, each rounded
to bfloat16, and their reduce-scatter sums them in bfloat16 (as Megatron-LM and torchtitan
do), where one process rounds the whole product once. That is one or two more bfloat16
roundings (2^-8 = 3.9e-3 each) per projection, in the forward and again in the backward,
which the replicated norms' weight gradients (sums over every token) collect. Measured on
CPU, one thread per rank: 1.1e-2 for llama at p = 2 x tp = 2 under 1f1b, zb-v and v-half
(4 layers, on blocks.1.attn_norm.weight), where the same runs without tp are bit for bit."""


class GradDiff(NamedTuple):
    name: str
    relative: float


def whole_model(model, *, seed: int) -> tuple[torch.nn.Module, Callable[[object, Tensor], Tensor]]:
    """(the whole model of `seed`, its loss on the model's output) for a `ModelChoice`, a
    `ModelSpec` or a built-in's config. The loss takes what the forward returns: logits, or a
    Hugging Face output object holding them."""
    dtype = None
    if isinstance(model, ModelChoice):
        dtype = getattr(torch, model.weights_dtype)
        model = model.spec()
    spec = spec_of(model)
    loss = spec.loss
    whole = build_model(spec, seed=seed, dtype=dtype)
    whole.pipeline_layout = spec.layout  # where its tied copies are named (`named_as_stages`)
    return whole, lambda output, targets: loss(model_logits(output), targets)


def named_as_stages(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The whole model's parameters by the names the pipeline's stages give them: a weight the
    head shares with the embedding (tied) appears under both names, as the first and the last
    stage each hold a copy of it."""
    named = dict(model.named_parameters())
    layout = getattr(model, "pipeline_layout", None)
    if layout is not None:
        for pair in tied_pairs(model, layout):
            named[pair.last] = named[pair.first]
    return named


def reference_step(
    cfg, *, seed: int, inputs: Tensor, targets: Tensor, microbatches: int, precision: PrecisionPolicy | None = None,
) -> tuple[float, dict[str, Tensor]]:
    """(mean microbatch loss, gradient of every parameter by name) for one step."""
    if inputs.size(0) % microbatches:
        raise ValueError(f"a batch of {inputs.size(0)} does not split into {microbatches} equal microbatches")
    model, loss_fn = whole_model(cfg, seed=seed)
    loss = _accumulate(model, loss_fn, inputs, targets, microbatches, precision)
    return loss, {n: p.grad.detach().clone() for n, p in named_as_stages(model).items()}


def reference_update(
    cfg, *, seed: int, inputs: Tensor, targets: Tensor, microbatches: int, lr: float,
    max_norm: float | None, precision: PrecisionPolicy | None = None,
) -> tuple[float, dict[str, Tensor], dict[str, Tensor], float]:
    """One step with synchronous clipping: (loss, clipped gradients, parameters after AdamW, global norm)."""
    model, loss_fn = whole_model(cfg, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = _accumulate(model, loss_fn, inputs, targets, microbatches, precision)
    norm = _clip(model, max_norm)
    optimizer.step()
    named = named_as_stages(model)
    grads = {n: p.grad.detach().clone() for n, p in named.items()}
    return loss, grads, {n: p.detach().clone() for n, p in named.items()}, norm


def reference_apply(cfg, *, seed: int, grads: Mapping[str, Tensor], lr: float) -> dict[str, Tensor]:
    """The parameters after one AdamW step from the seed's weights with the given gradients.

    `train --verify` checks the ranks' optimizer step with this, on the gradients the ranks
    used: AdamW's first step moves each weight by about lr * g / (|g| + eps), a sign of g
    for every gradient above eps, so two correct runs whose gradients differ by rounding
    (float32 sums in another order: microbatches, replicas, reduce-scatter) move a weight
    whose gradient is near zero by very different amounts. Those gradients are compared
    with the reference's own; the step is compared with the step the reference optimizer
    takes from the same gradients, which is well conditioned. A tied weight steps with the
    gradient its first-stage copy holds."""
    model, _ = whole_model(cfg, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for name, param in model.named_parameters():
        if name not in grads:
            raise ValueError(f"no gradient for parameter {name!r}: give the gradient of every parameter")
        param.grad = grads[name].to(dtype=param.dtype, device=param.device).clone()
    optimizer.step()
    return {n: p.detach().clone() for n, p in named_as_stages(model).items()}


def reference_losses(
    cfg, *, seed: int, batches: Iterable[tuple[Tensor, Tensor]], microbatches: int, lr: float,
    max_norm: float | None = None, skip: Container[int] = (),
) -> list[float]:
    """Each step's loss over `batches`, clipping synchronously; the steps in `skip` (0-based) compute
    their loss but make no update, as a run without that batch's update."""
    model, loss_fn = whole_model(cfg, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step, (inputs, targets) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        losses.append(_accumulate(model, loss_fn, inputs, targets, microbatches))
        if step not in skip:
            _clip(model, max_norm)
            optimizer.step()
    return losses


def _accumulate(model: torch.nn.Module, loss_fn, inputs: Tensor, targets: Tensor, microbatches: int,
                precision: PrecisionPolicy | None = None) -> float:
    """Each microbatch forward and backward with loss/m, in `precision` (None: the weights' own)."""
    run, copies = model, None
    if precision is not None and precision.mixed:
        copies = ComputeCopies({0: model}, torch_dtype(precision.compute))
        run = copies.stages[0]
        copies.begin_step()
    total = 0.0
    for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
        loss = loss_fn(run(x), y)
        (loss / microbatches).backward()
        total += loss.item()
    if copies is not None:
        copies.end_step()
    return total / microbatches


def _clip(model: torch.nn.Module, max_norm: float | None) -> float:
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


def in_float64(model):
    """The same `ModelChoice` on float64 weights: the truth a bfloat16 run is measured against."""
    import dataclasses

    if model.config is not None:
        return dataclasses.replace(model, config=dataclasses.replace(model.config, dtype="float64"), _spec=None)
    return dataclasses.replace(model, dtype="float64", _spec=None)


ROUNDING_NOISE_FACTOR = 3.0
"""How many times one process's own bfloat16 error a vocabulary-parallel gradient may add to
bf16-mixed's tolerance when both are judged against float64 (`excess_error`)."""


class ExcessError(NamedTuple):
    """A gradient's relative distance to the float64 truth, for the pipeline and for one process."""

    name: str
    pipeline: float
    one_process: float

    @property
    def relative(self) -> float:
        """What is compared with bf16-mixed's tolerance: the pipeline's distance less the rounding
        noise one process shows on the same gradient (ROUNDING_NOISE_FACTOR times its distance)."""
        return self.pipeline - ROUNDING_NOISE_FACTOR * self.one_process


def excess_error(got: Mapping[str, Tensor], one_process: Mapping[str, Tensor],
                 truth: Mapping[str, Tensor]) -> ExcessError:
    """The gradient whose distance to `truth` (float64) most exceeds what one process's own
    bfloat16 error allows: `train --verify` under bf16-mixed with --vocab-parallel accepts
    pipeline <= TOLERANCE["bf16-mixed"] + ROUNDING_NOISE_FACTOR x one process, per gradient,
    each distance relative to the gradient's largest element.

    Vocabulary parallelism computes the head with other arithmetic, not the same arithmetic in
    another order: each rank normalises its softmax shard by its own maximum and sum, its
    bfloat16 product for dL/dX rounds the local softmax P~_r where one process rounds the global
    P - onehot(y), and the shards' partial products meet in a float32 all-reduce. The two runs
    are two bfloat16 computations of one gradient, and an ill-conditioned gradient amplifies
    their roundings differently: with random weights attention is nearly uniform, so the query
    and key projections' gradients are small differences of larger terms, and one process in
    bfloat16 is itself up to 4.5e-2 from the truth there. So a gradient is judged against the
    truth, with room in proportion to the rounding noise one process shows on it: tight where
    a gradient is well conditioned (the head's, the values'), loose only where one process is
    loose too. A wrong formula (the rescaling exp(m_r - M) left out, say) is off by the
    gradient's own size and fails by far.

    Measured on CPU, three seeds each of the built-in Llama (v-half p = 4), a tied Qwen2 with
    vocabulary 320 (zb-v p = 2) and one with vocabulary 151,936 (1f1b p = 2): the pipeline's
    distance is at most 2.05 times one process's, at most 0.56 of what this rule allows, and the
    largest is 4.5e-2 on a key bias where one process is at 3.5e-2; the loss agrees to 3e-7.
    """
    if got.keys() != truth.keys() or one_process.keys() != truth.keys():
        missing = sorted(truth.keys() - got.keys())
        raise ValueError(f"pipeline gradients do not cover the model: missing {missing[:5]}")
    worst = ExcessError("", 0.0, 0.0)
    for name, exact in truth.items():
        if got[name] is None:
            return ExcessError(name, float("inf"), 0.0)
        row = ExcessError(name, relative_difference(got[name], exact), relative_difference(one_process[name], exact))
        if row.relative > worst.relative or not worst.name:
            worst = row
    return worst


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
