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
  as a history of every version still needed), or, in nesterov, at the look-ahead point
  from them;
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

from ...core.lowering.versions import WeightVersions
from ...core.lowering.async_mode import AsyncMode
from .stage import AsyncStage

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
    """|w_{v_B} - w_F|: the current weights' distance from the weights w_F the forward used
    (w_{v_F}, or nesterov's look-ahead point)"""
    used: float
    """|u - w_F| for the weights u the backward computed with"""


@dataclass(frozen=True)
class ReplayResult:
    losses: tuple[float, ...]
    """per optimizer step, the mean loss of its microbatches (as their forwards saw it)"""
    lrs: tuple[tuple[float, ...], ...]
    """per optimizer step, the learning rate of each stage's first parameter group"""
    discrepancies: tuple[Discrepancy, ...]
    """every backward with delay >= 1, when measured (`measure_discrepancy=True`)"""


def replay(
    stages: Sequence[nn.Module],
    versions: WeightVersions,
    microbatches: Sequence[tuple[Tensor, Tensor]],
    *,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    mode: AsyncMode,
    measure_discrepancy: bool = False,
    nominal_delays: Sequence[int] | None = None,
    lr_factor: Callable[[int], float] | None = None,
) -> ReplayResult:
    """Train `stages` in place through the asynchronous run that `versions` describes,
    as `mode` defines it (see the module doc). Returns the per-step losses and rates.

    nominal_delays: per stage, the delay T2's gamma is set from (None: the stage's largest
    in `versions`; the runtime passes the steady state's, `plan.nominal_delays`).
    lr_factor: step -> the learning-rate schedule over its peak (None: constant).
    A pipemare mode without K gets the default for the replay's steps (`AsyncMode.for_run`;
    resolve it first when the schedule spans more steps than are replayed)."""
    if len(stages) != versions.num_stages:
        raise ValueError(f"{len(stages)} stage modules given for versions of {versions.num_stages} stages")
    n = versions.step_size
    if mode.sync_warmup_steps:
        versions = WeightVersions.synchronous(versions.num_stages, n, mode.sync_warmup_steps).then(versions)
    mode = mode.for_run(versions.steps)
    if len(microbatches) != versions.microbatches:
        raise ValueError(
            f"{len(microbatches)} microbatches given for {versions.steps} steps of {n} "
            f"({mode.sync_warmup_steps} of them synchronous): give {versions.microbatches}"
        )
    S = versions.num_stages
    # the caller keeps the versions: forwards here run at past versions the runtime's never see
    state = [
        AsyncStage(module, optimizer(list(module.parameters())), mode,
                   versions.max_delay(s) if nominal_delays is None else nominal_delays[s], auto_forget=False,
                   lr_factor=lr_factor)
        for s, module in enumerate(stages)
    ]
    # the oldest version any later microbatch still needs, per stage: older ones are dropped
    oldest = [_suffix_min(versions.forward[s]) for s in range(S)]

    losses, lrs, gaps = [], [], []
    for step in range(versions.steps):
        total = 0.0
        for m in range(step * n, (step + 1) * n):
            x, target = microbatches[m]
            inputs, loss = _forward(state, versions, m, x, target, loss_fn)
            total += loss
            _backward(state, versions, m, inputs, target, loss_fn, n, gaps if measure_discrepancy else None)
        losses.append(total / n)
        rates = []
        for s, stage in enumerate(state):
            later = (step + 1) * n
            needed = oldest[s][later] if later < versions.microbatches else None
            stage.step(step, keep_old=needed is not None and needed <= stage.version)
            rates.append(stage.optimizer.param_groups[0]["lr"])
            if needed is not None:
                stage.forget_before(needed)
        lrs.append(tuple(rates))
    return ReplayResult(tuple(losses), tuple(lrs), tuple(gaps))


def _suffix_min(values: Sequence[int]) -> list[int]:
    out, low = [0] * len(values), None
    for i in range(len(values) - 1, -1, -1):
        low = values[i] if low is None else min(low, values[i])
        out[i] = low
    return out


def _forward(state: list[AsyncStage], versions, m, x, target, loss_fn) -> tuple[list[Tensor], float]:
    """Run microbatch m through every stage at its forward weights; the stage inputs
    (kept for the backward's recomputation) and the loss."""
    inputs = []
    for s, stage in enumerate(state):
        inputs.append(x)
        v_f = stage.begin(m, versions.forward[s][m])
        x = stage.forward(x, v_f, versions.backward[s][m])
    with torch.no_grad():
        return inputs, float(loss_fn(x, target))


def _backward(state: list[AsyncStage], versions, m, inputs, target, loss_fn, n, gaps) -> None:
    grad_out = None
    step, last = m // n, len(state) - 1
    for s in range(last, -1, -1):
        stage = state[s]
        v_b = versions.backward[s][m]
        v_f = stage.end(m, v_b)
        delay = v_b - v_f
        if gaps is not None and delay >= 1:
            seen = stage.forward_weights(v_f, v_b)
            gaps.append(Discrepancy(
                step, s, m, delay, _distance(stage.weights(v_b), seen),
                _distance(stage.backward_weights(v_f, v_b), seen),
            ))
        grad_out = stage.backward(
            inputs[s], v_f, v_b, grad_out=grad_out, target=target if s == last else None, loss_fn=loss_fn,
            scale=n, input_grad=s > 0,
        )


def _distance(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    return float(torch.sqrt(sum(((x - y).double() ** 2).sum() for x, y in zip(a, b))))
