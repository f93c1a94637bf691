"""Optimizer post-validation: global-norm clipping and non-finite skips without a barrier.

    >>> check = PostValidator(optimizer, max_norm=1.0)   # in every rank, over its own parameters
    >>> runner.step(x, y); check.step()                 # instead of optimizer.step()
    StepCheck(norm=0.83, coefficient=1.0, outcome='stepped', optimistic=True, rolled_back=False, ...)

Clipping by the global gradient norm, and skipping a step whose gradient is non-finite
anywhere, both need every rank's gradients before any rank may step: done plainly, that is
a barrier (an all-reduce of the squared norms) between the last backward and the optimizer
step, and every rank waits for the slowest rank's last backward plus the all-reduce. Zero
Bubble (Qi et al., 2024, section 4) removes the wait by validating after the step:

1. each rank computes its squared gradient norm (float64, so that float32 squares cannot
   overflow) and starts `dist.all_reduce(async_op=True)` of it;
2. if its own part is already unsafe (non-finite, or large enough that the global norm must
   clip) it knows the step is wrong and does not take it; otherwise it saves the parameters
   and optimizer state and steps at once, optimistically;
3. it then waits for the global squared norm: non-finite -> the step is undone (skipped on
   every rank); norm above `max_norm` -> undone, the gradients are scaled by the clip
   coefficient and the step is redone; otherwise the optimistic step stands.

The clip coefficient is torch's (`clip_grad_norm_`): max_norm / (norm + 1e-6), applied only
when below 1. The optimistic step is tentative (tentative.py): for torch's Adam and AdamW
it is computed into spare buffers and swapped in once the check passes, so undoing costs
nothing and the result is bit for bit torch's own (single-tensor) step, at the price of a
spare copy of the parameters and both moments; for any other optimizer the parameters
and state are copied before the step and copied back to undo. Every step that is not
optimistic (a redo, or the barrier) is the optimizer's own `step()`.

`optimistic=False` is the barrier (all-reduce, wait, then `optimizer.step()`): the same
decisions, no spare buffers, and every rank waits for the slowest before stepping.
"""
from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from .tentative import tentative_step

__all__ = ["CLIP_EPS", "PostValidator", "StepCheck", "clip_coefficient"]

CLIP_EPS = 1e-6
"""Added to the norm in the clip coefficient, as torch.nn.utils.clip_grad_norm_ does."""

Outcome = Literal["stepped", "clipped", "skipped"]


def clip_coefficient(norm: float, max_norm: float | None) -> float:
    """The factor the gradients are multiplied by: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (norm + CLIP_EPS))


@dataclass(frozen=True)
class StepCheck:
    """What one validated optimizer step did on this rank.

    norm: the global gradient norm over all ranks (inf or nan when a gradient is non-finite).
    coefficient: the clip coefficient the step used (1.0 unclipped; 0.0 when skipped).
    outcome: "stepped" (unclipped), "clipped", or "skipped" (non-finite: no update at all).
    optimistic: this rank stepped before the global norm was known.
    rolled_back: that optimistic step was undone (then redone clipped, or skipped).
    wait_s: time blocked on the all-reduce (after the optimistic step, or before the step
        with a barrier).
    """

    norm: float
    coefficient: float
    outcome: Outcome
    optimistic: bool
    rolled_back: bool
    wait_s: float


class PostValidator:
    """Steps `optimizer` after checking the global gradient norm of all ranks in `group`.

    optimizer: this rank's optimizer; its parameters are the rank's share of the model
        (every rank of `group` must call `step` once per training step).
    max_norm: clip the global gradient norm to this (None: no clipping, non-finite check only).
    group: the process group whose ranks hold the whole model (default: the world).
    optimistic: step before the global norm arrives and undo if needed (True), or wait for
        it first (False: the barrier).
    timeout_s: the wait for the all-reduce gives up after this long (None: the group's).
    counted_twice: parameters whose gradient another parameter of the run also holds (the
        last stage's copy of a tied embedding): left out of the norm, clipped with the rest.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_norm: float | None = None,
        group: dist.ProcessGroup | None = None,
        optimistic: bool = True,
        timeout_s: float | None = None,
        counted_twice=(),
    ) -> None:
        if max_norm is not None and not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm)
                                         and max_norm > 0):
            raise ValueError(f"max_norm must be a finite number > 0 (or None for no clipping), got {max_norm!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.optimizer = optimizer
        self.max_norm = None if max_norm is None else float(max_norm)
        self.group = group
        self.optimistic = optimistic
        self.timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        skipped = {id(p) for p in counted_twice}
        self._norm_params = [p for p in self._params if id(p) not in skipped]
        self._update = tentative_step(optimizer)

    def step(self) -> StepCheck:
        """Validate and take (or undo, redo, skip) this rank's optimizer step."""
        grads = [p.grad for p in self._params if p.grad is not None]
        total = self._squared_norm([p.grad for p in self._norm_params if p.grad is not None])
        if not self.optimistic:
            start = time.perf_counter()
            self._all_reduce(total, async_op=False)
            wait = time.perf_counter() - start
            return self._finish(grads, total.item(), stepped=False, wait_s=wait)
        reduced = total.clone()
        work = self._all_reduce(reduced, async_op=True)
        local = total.item()
        stepped = math.isfinite(local) and clip_coefficient(math.sqrt(local), self.max_norm) == 1.0
        if stepped:
            self._update.take()
        start = time.perf_counter()
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)
        wait = time.perf_counter() - start
        return self._finish(grads, reduced.item(), stepped=stepped, wait_s=wait)

    # ---- the decision, once the global squared norm is known ----------------------------
    def _finish(self, grads: list[torch.Tensor], squared: float, *, stepped: bool, wait_s: float) -> StepCheck:
        norm = math.sqrt(squared) if squared >= 0 else math.nan
        if not math.isfinite(squared):
            if stepped:
                self._update.drop()
            return StepCheck(norm, 0.0, "skipped", stepped, stepped, wait_s)
        coefficient = clip_coefficient(norm, self.max_norm)
        if coefficient < 1.0:
            if stepped:
                self._update.drop()
            torch._foreach_mul_(grads, coefficient)
            self.optimizer.step()
            return StepCheck(norm, coefficient, "clipped", stepped, stepped, wait_s)
        if stepped:
            self._update.keep()
        else:
            # the barrier, or rounding made the local part look unsafe while the sum is not
            self.optimizer.step()
        return StepCheck(norm, 1.0, "stepped", stepped, False, wait_s)

    def _squared_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        device = grads[0].device if grads else (self._params[0].device if self._params else torch.device("cpu"))
        if not grads:
            return torch.zeros(1, dtype=torch.float64, device=device)
        # per-tensor norms in the gradients' dtype, as clip_grad_norm_ computes them; their
        # squares are summed in float64, where a float32 norm cannot overflow when squared
        norms = torch._foreach_norm([g.detach() for g in grads])
        return torch.stack(norms).to(torch.float64).square().sum().reshape(1)

    def _all_reduce(self, tensor: torch.Tensor, *, async_op: bool):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return work if async_op else tensor
