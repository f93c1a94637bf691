"""The specification of asynchronous training: one process replays a run's delays.

    >>> from pipeblocks.core import weight_versions
    >>> from pipeblocks.schedules.asynchronous import async_1f1b
    >>> versions = weight_versions(async_1f1b(p=4, n=2, steps=10))
    >>> result = replay(stages, versions, microbatches, loss_fn=cross_entropy,
    ...                 optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    ...                 mode=AsyncMode("pipemare", lr_warmup_steps=5))
    >>> result.losses          # one per optimizer step

`stages` are the model's p stage modules (trained in place), `versions` the weight
version every forward and backward of the asynchronous Program sees, `microbatches` the
stream of (input, target) pairs, N per step. Step k applies the gradients of
microbatches k*N .. k*N+N-1; for each of them, in order:

- forward: stage s runs at its weights of version `versions.forward[s][m]` (kept here
  as a history of every version still needed);
- backward: stage s recomputes its forward from the input it received, at the weights
  the mode names (`async_mode.py`), and backpropagates the gradient of its output
  through that recomputation, adding to its weight gradient and passing the gradient of
  its input on; the loss of the last stage is scaled by 1/N, as in synchronous training;
- then each stage sets its learning rate (T1 in pipemare), steps its optimizer and
  records the new version (and T2's velocity estimate).

Why the recomputation: the activations of F(m) were made with the forward's weights, so
a backward through them would mix two weight versions. Recomputing at the backward's
weights makes the mode's weights the only ones the backward sees: the same for pipedream
(whose weights are the forward's), w_{v_B} for naive and the estimate of w_{v_F} for
pipemare. It also matches what a runtime without weight stashing can compute: it keeps
the stage input and rebuilds the rest.

With a synchronous warm-up of W steps the run is W synchronous steps followed by
`versions` (W + versions.steps steps in all). When every delay is 0 (one step, one
stage, or all steps synchronous) every mode is ordinary synchronous training.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..core.versions import WeightVersions
from .async_mode import AsyncMode, t1_multiplier

__all__ = ["Discrepancy", "ReplayResult", "replay"]


@dataclass(frozen=True)
class Discrepancy:
    """How far the backward's weights are from the forward's, for one delayed backward:
    Euclidean norms over all of the stage's parameters."""

    step: int
    stage: int
    microbatch: int
    delay: int
    uncorrected: float
    """|w_{v_B} - w_{v_F}|: the current weights' distance from the forward's"""
    used: float
    """|u - w_{v_F}| for the weights u the backward computed with"""


@dataclass(frozen=True)
class ReplayResult:
    losses: tuple[float, ...]
    """per optimizer step, the mean loss of its microbatches (as their forwards saw it)"""
    lrs: tuple[tuple[float, ...], ...]
    """per optimizer step, the learning rate of each stage's first parameter group"""
    discrepancies: tuple[Discrepancy, ...]
    """every backward with delay >= 1, when measured (`measure_discrepancy=True`)"""


class _Stage:
    """One stage's replay state: its module and optimizer, the versions of its weights
    still needed, and T2's velocity estimate per version."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, gamma: float | None) -> None:
        self.module = module
        self.names = [name for name, _ in module.named_parameters()]
        self.params = [param for _, param in module.named_parameters()]
        self.optimizer = optimizer
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.gamma = gamma
        self.weights: dict[int, tuple[Tensor, ...]] = {0: self._snapshot()}
        self.delta: dict[int, tuple[Tensor, ...]] = {0: tuple(torch.zeros_like(p) for p in self.params)}

    def _snapshot(self) -> tuple[Tensor, ...]:
        return tuple(p.detach().clone() for p in self.params)

    def call(self, weights: Sequence[Tensor], x: Tensor) -> Tensor:
        return functional_call(self.module, dict(zip(self.names, weights)), (x,))

    def step(self, version: int, lr_factor: float) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * lr_factor
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        new, old = self._snapshot(), self.weights[version]
        self.weights[version + 1] = new
        if self.gamma is not None:
            g = self.gamma
            self.delta[version + 1] = tuple(
                g * d + (1 - g) * (a - b) for d, a, b in zip(self.delta[version], new, old)
            )

    def forget_before(self, version: int) -> None:
        for table in (self.weights, self.delta):
            for v in [v for v in table if v < version]:
                del table[v]


def replay(
    stages: Sequence[nn.Module],
    versions: WeightVersions,
    microbatches: Sequence[tuple[Tensor, Tensor]],
    *,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    mode: AsyncMode,
    measure_discrepancy: bool = False,
) -> ReplayResult:
    """Train `stages` in place through the asynchronous run that `versions` describes,
    as `mode` defines it (see the module doc). Returns the per-step losses and rates."""
    if len(stages) != versions.num_stages:
        raise ValueError(f"{len(stages)} stage modules given for versions of {versions.num_stages} stages")
    n = versions.step_size
    if mode.sync_warmup_steps:
        versions = WeightVersions.synchronous(versions.num_stages, n, mode.sync_warmup_steps).then(versions)
    if len(microbatches) != versions.microbatches:
        raise ValueError(
            f"{len(microbatches)} microbatches given for {versions.steps} steps of {n} "
            f"({mode.sync_warmup_steps} of them synchronous): give {versions.microbatches}"
        )
    S = versions.num_stages
    state = []
    for s, module in enumerate(stages):
        nominal = versions.max_delay(s)
        gamma = mode.d ** (1.0 / nominal) if mode.d < 1 and nominal >= 1 else None
        state.append(_Stage(module, optimizer(list(module.parameters())), gamma))
    # the oldest version any later microbatch still needs, per stage: older ones are dropped
    oldest = [_suffix_min(versions.forward[s]) for s in range(S)]

    losses, lrs, gaps = [], [], []
    for step in range(versions.steps):
        total = 0.0
        for m in range(step * n, (step + 1) * n):
            x, target = microbatches[m]
            inputs, loss = _forward(state, versions, m, x, target, loss_fn)
            total += loss
            _backward(state, versions, mode, m, inputs, target, loss_fn, n, gaps if measure_discrepancy else None)
        losses.append(total / n)
        rates = []
        for s, stage in enumerate(state):
            factor = t1_multiplier(versions.step_delay(s, step), step, mode.k)
            stage.step(step, factor)
            rates.append(stage.optimizer.param_groups[0]["lr"])
            if (step + 1) * n < versions.microbatches:
                stage.forget_before(oldest[s][(step + 1) * n])
        lrs.append(tuple(rates))
    return ReplayResult(tuple(losses), tuple(lrs), tuple(gaps))


def _suffix_min(values: Sequence[int]) -> list[int]:
    out, low = [0] * len(values), None
    for i in range(len(values) - 1, -1, -1):
        low = values[i] if low is None else min(low, values[i])
        out[i] = low
    return out


@torch.no_grad()
def _forward(state, versions, m, x, target, loss_fn) -> tuple[list[Tensor], float]:
    """Run microbatch m through every stage at its forward versions; the stage inputs
    (kept for the backward's recomputation) and the loss."""
    inputs = []
    for s, stage in enumerate(state):
        inputs.append(x)
        x = stage.call(stage.weights[versions.forward[s][m]], x)
    return inputs, float(loss_fn(x, target))


def _backward(state, versions, mode: AsyncMode, m, inputs, target, loss_fn, n, gaps) -> None:
    grad_out = None
    step, last = m // n, len(state) - 1
    for s in range(last, -1, -1):
        stage = state[s]
        v_f, v_b = versions.forward[s][m], versions.backward[s][m]
        delay = v_b - v_f
        weights = _backward_weights(stage, mode, v_f, v_b)
        if gaps is not None and delay >= 1:
            gaps.append(Discrepancy(
                step, s, m, delay, _distance(stage.weights[v_b], stage.weights[v_f]),
                _distance(weights, stage.weights[v_f]),
            ))
        leaves = [w.detach().requires_grad_(True) for w in weights]
        x = inputs[s]
        wants_input_grad = s > 0 and x.is_floating_point()
        if wants_input_grad:
            x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = stage.call(leaves, x)
            if s == last:  # the loss, scaled as a synchronous step scales it
                out = loss_fn(out, target) / n
            sources = [x, *leaves] if wants_input_grad else leaves
            grads = torch.autograd.grad(out, sources, grad_outputs=grad_out, allow_unused=True)
        if wants_input_grad:
            grad_out, grads = grads[0], grads[1:]
        for param, grad in zip(stage.params, grads):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad.detach().clone()
            else:
                param.grad += grad


def _backward_weights(stage: _Stage, mode: AsyncMode, v_f: int, v_b: int) -> tuple[Tensor, ...]:
    if mode.name == "pipedream":
        return stage.weights[v_f]
    current = stage.weights[v_b]
    delay = v_b - v_f
    if mode.name == "naive" or stage.gamma is None or delay == 0:
        return current
    return tuple(w - delay * d for w, d in zip(current, stage.delta[v_b]))


def _distance(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    return float(torch.sqrt(sum(((x - y).double() ** 2).sum() for x, y in zip(a, b))))
