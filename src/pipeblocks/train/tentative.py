"""An optimizer step that can be taken tentatively, then kept or dropped.

    >>> step = tentative_step(optimizer)   # AdamOutOfPlace for torch's Adam/AdamW, else CopyRollback
    >>> step.take()                         # the update, not yet the state of record
    >>> step.keep()   or   step.drop()      # drop(): as if take() had never run

Post-validation (post_validation.py) steps before it knows whether the step is right, so
it needs to undo a step cheaply and exactly. Two ways:

* `AdamOutOfPlace` (torch.optim.Adam and AdamW, the usual options): the update is
  computed into spare buffers, element for element the arithmetic of torch's
  single-tensor Adam (`foreach=False`), so it equals torch bit for bit; `keep` swaps the
  buffers in (no copy), `drop` leaves them. The memory traffic is that of a plain step;
  the price is one spare copy of the parameters and both moments (3x the parameters).
  The Zero Bubble paper inverts AdamW in place instead, which needs no memory but is
  exact only up to rounding.
* `CopyRollback` (any other optimizer): save copies of the parameters and every state
  tensor, step, and copy them back on `drop`. Exact, but the copies cost about as much
  memory traffic as the step itself.

torch's foreach and fused Adam kernels may round differently from its single-tensor one;
`AdamOutOfPlace` follows the single-tensor one, which torch uses on CPU by default.
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import _get_scalar_dtype

__all__ = ["AdamOutOfPlace", "CopyRollback", "tentative_step"]


def tentative_step(optimizer: torch.optim.Optimizer) -> AdamOutOfPlace | CopyRollback:
    """The cheapest exact tentative step for `optimizer`."""
    if AdamOutOfPlace.supports(optimizer):
        return AdamOutOfPlace(optimizer)
    return CopyRollback(optimizer)


class AdamOutOfPlace:
    """torch's Adam/AdamW step, computed into spare buffers and committed by swapping."""

    _UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable", "fused")

    @classmethod
    def supports(cls, optimizer: torch.optim.Optimizer) -> bool:
        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            return False
        for group in optimizer.param_groups:
            if any(group.get(flag) for flag in cls._UNSUPPORTED):
                return False
            if isinstance(group["lr"], torch.Tensor) or any(isinstance(b, torch.Tensor) for b in group["betas"]):
                return False
            if any(p.is_complex() or p.is_sparse for p in group["params"]):
                return False
        return True

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.supports(optimizer):
            raise TypeError(
                f"AdamOutOfPlace takes torch.optim.Adam or AdamW without {', '.join(self._UNSUPPORTED)}, got "
                f"{type(optimizer).__name__}: use CopyRollback (tentative_step picks it)"
            )
        self.optimizer = optimizer
        self._spare: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pending: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @torch.no_grad()
    def take(self) -> None:
        self._pending = []
        for group in self.optimizer.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            decoupled = group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.optimizer.state.get(p) or {}
                step_t = state.get("step", torch.tensor(0.0, dtype=_get_scalar_dtype()))
                exp_avg = state.get("exp_avg")
                exp_avg_sq = state.get("exp_avg_sq")
                new_p, new_m, new_v = self._buffers(p)
                # the operations and their order are those of torch.optim.adam._single_tensor_adam
                new_step = step_t + 1
                if weight_decay != 0 and not decoupled:
                    grad = grad.add(p, alpha=weight_decay)
                if weight_decay != 0 and decoupled:
                    torch.mul(p, 1 - lr * weight_decay, out=new_p)
                else:
                    new_p.copy_(p)
                if exp_avg is None:
                    new_m.zero_().lerp_(grad, 1 - beta1)
                    new_v.zero_().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                else:
                    torch.lerp(exp_avg, grad, 1 - beta1, out=new_m)
                    torch.mul(exp_avg_sq, beta2, out=new_v).addcmul_(grad, grad, value=1 - beta2)
                step = new_step.item()
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                bias_correction2_sqrt = bias_correction2**0.5
                denom = (new_v.sqrt() / bias_correction2_sqrt).add_(eps)
                new_p.addcdiv_(new_m, denom, value=-step_size)
                self._pending.append((p, new_p, new_m, new_v, new_step))

    @torch.no_grad()
    def keep(self) -> None:
        for p, new_p, new_m, new_v, new_step in self._pending:
            state = self.optimizer.state[p]
            old_p, old_m, old_v = p.data, state.get("exp_avg"), state.get("exp_avg_sq")
            p.data = new_p
            state["step"], state["exp_avg"], state["exp_avg_sq"] = new_step, new_m, new_v
            if old_m is not None and old_v is not None:
                self._spare[id(p)] = (old_p, old_m, old_v)  # next step's spare buffers
            else:
                self._spare.pop(id(p), None)
        self._pending = []

    def drop(self) -> None:
        self._pending = []

    def _buffers(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        spare = self._spare.pop(id(p), None)
        if spare is not None and all(t.shape == p.shape and t.dtype == p.dtype and t.device == p.device
                                     and t.stride() == p.stride() for t in spare):
            return spare
        return tuple(torch.empty_like(p) for _ in range(3))


class CopyRollback:
    """Any optimizer: copies of the parameters and state before the step, copied back on drop."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._param_copies: list[torch.Tensor] | None = None
        self._state_copies: dict[tuple[int, str], torch.Tensor] = {}
        self._saved: list[dict | None] = []

    @torch.no_grad()
    def take(self) -> None:
        if self._param_copies is None:
            self._param_copies = [torch.empty_like(p) for p in self._params]
        torch._foreach_copy_(self._param_copies, [p.detach() for p in self._params])
        saved: list[dict | None] = []
        for i, p in enumerate(self._params):
            state = self.optimizer.state.get(p)
            if not state:
                saved.append(None)
                continue
            entry = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    copy = self._state_copies.get((i, key))
                    if copy is None or copy.shape != value.shape or copy.dtype != value.dtype:
                        copy = self._state_copies[(i, key)] = torch.empty_like(value)
                    copy.copy_(value)
                    entry[key] = copy
                else:
                    entry[key] = value
            saved.append(entry)
        self._saved = saved
        self.optimizer.step()

    def keep(self) -> None:
        self._saved = []

    @torch.no_grad()
    def drop(self) -> None:
        torch._foreach_copy_([p.detach() for p in self._params], self._param_copies)
        for p, entry in zip(self._params, self._saved):
            if entry is None:
                # the tentative step created this state: without it the next step starts afresh
                self.optimizer.state.pop(p, None)
                continue
            state = self.optimizer.state[p]
            for key in [k for k in state if k not in entry]:
                del state[key]
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
                    state[key].copy_(value)
                elif isinstance(value, torch.Tensor):
                    state[key] = value.clone()
                else:
                    state[key] = value
        self._saved = []
