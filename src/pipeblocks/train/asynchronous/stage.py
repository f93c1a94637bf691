"""One stage's side of an asynchronous mode: the only place a mode's weights are chosen.

Both the one-process replay (`reference.replay`, the specification) and the
multi-process runtime (`compute.AsyncCompute`, one per rank) drive an `AsyncStage`
per stage, so what a mode computes is written once:

    begin(m, version)        F(m) sees the stage at `version` (default: the current one)
    forward(x, v_f, v_b)     the forward, at the weights the mode gives a forward
    end(m, version) -> v_f   B(m) runs at `version`; returns the forward's version
    backward(x, v_f, v_b, grad_out | target)
                             recompute the forward from the stage input at the weights
                             the mode gives a backward, backpropagate, add to `.grad`
    step(step)               set the learning rate (the run's schedule times T1's factor),
                             step, make the next version, update the velocity estimate (T2)
    state() / load_state()   the mode's own state between steps (version, T2's velocity),
                             for checkpoints; only with no microbatch in flight

A forward is told its backward's version too (`v_b`, read off the Program): a mode may
look ahead from it. Versions other than the current one are kept frozen only while some
microbatch still needs them: in the runtime, a stashing mode keeps the version of every
forward whose backward has not run (`STASHING`); the replay, which runs forwards at past
versions, says what to keep itself (`keep_old=`, `forget_before`).

A new mode is its definition in `async_mode.py` and its branch in `forward_weights` /
`backward_weights` here (and in `STASHING` if its backward needs the forward's weights);
the replay and the runtime then run it unchanged.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ...core.lowering.async_mode import AsyncMode, lookahead, t1_multiplier

__all__ = ["STASHING", "AsyncStage"]

STASHING = frozenset({"pipedream"})
"""Modes whose backward needs the weights its forward used: the runtime keeps them (a stash)."""


class AsyncStage:
    """One stage's module and optimizer under `mode`.

    nominal_delay: the stage's largest delay in the steady state (T2's gamma = D^(1/nominal_delay)).
    auto_forget: keep a past version only while a forward in flight saw it (the runtime);
        False: the caller says what to keep (`step(keep_old=)`, `forget_before`).
    lr_factor: step -> the run's learning-rate schedule over its peak (None: constant);
        T1's factor multiplies it.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, mode: AsyncMode,
                 nominal_delay: int, *, auto_forget: bool = True,
                 lr_factor: Callable[[int], float] | None = None) -> None:
        if not isinstance(nominal_delay, int) or nominal_delay < 0:
            raise ValueError(f"nominal_delay must be an integer >= 0, got {nominal_delay!r}")
        self.module = module
        self.mode = mode
        self.names = [name for name, _ in module.named_parameters()]
        self.params = [param for _, param in module.named_parameters()]
        self.optimizer = optimizer
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.lr_factor = lr_factor
        self.auto_forget = auto_forget
        self.gamma = mode.d ** (1.0 / nominal_delay) if mode.d < 1 and nominal_delay >= 1 else None
        self.version = 0
        self._frozen: dict[int, tuple[Tensor, ...]] = {}  # past versions still needed
        self._delta: dict[int, tuple[Tensor, ...]] = {}  # T2's velocity estimate per version kept
        if self.gamma is not None:
            self._delta[0] = tuple(torch.zeros_like(p) for p in self.params)
        self._in_flight: dict[int, int] = {}  # microbatch -> version its forward saw
        self._step_delay = 0  # largest delay among the backwards since the last step
        self.delays: dict[int, int] = {}  # microbatch -> its delay, as measured at its backward
        self.most_versions = 1
        """the most weight versions held at once (the current one and those kept frozen)"""

    # ---- versions ------------------------------------------------------------------
    def weights(self, version: int) -> tuple[Tensor, ...]:
        """The stage's weights of `version`: the live parameters for the current one."""
        if version == self.version:
            return tuple(p.detach() for p in self.params)
        try:
            return self._frozen[version]
        except KeyError:
            raise RuntimeError(
                f"weight version {version} of this stage is not kept (current {self.version}, kept "
                f"{sorted(self._frozen)}): a forward or backward runs at a version the run did not plan for"
            ) from None

    def delta(self, version: int) -> tuple[Tensor, ...] | None:
        """T2's velocity estimate at `version` (None when the mode keeps none)."""
        return None if self.gamma is None else self._delta[version]

    def forward_weights(self, v_f: int, v_b: int) -> tuple[Tensor, ...]:
        """What the forward of a microbatch with versions (v_f, v_b) computes with: the
        weights of v_f, moved ahead along the velocity estimate in nesterov."""
        found = self.weights(v_f)
        ahead = lookahead(self.mode, v_b - v_f)
        if ahead == 0 or self.gamma is None:
            return found
        return tuple(w + ahead * d for w, d in zip(found, self._delta[v_f]))

    def backward_weights(self, v_f: int, v_b: int) -> tuple[Tensor, ...]:
        """What its backward computes with (see async_mode.py for each mode)."""
        name, delay = self.mode.name, v_b - v_f
        if name == "pipedream":
            return self.weights(v_f)
        current = self.weights(v_b)
        if name in ("naive", "nesterov") or self.gamma is None or delay == 0:
            return current
        return tuple(w - delay * d for w, d in zip(current, self._delta[v_b]))

    # ---- passes --------------------------------------------------------------------
    def begin(self, microbatch: int, version: int | None = None) -> int:
        """Record that F(microbatch) sees `version` (default: the current one); returns it."""
        v_f = self.version if version is None else version
        self._forget_unused()
        self._in_flight[microbatch] = v_f
        return v_f

    def end(self, microbatch: int, version: int | None = None) -> int:
        """Record that B(microbatch) runs at `version` (default: the current one); returns
        the version its forward saw. The delay counts towards this step's T1 rate."""
        v_b = self.version if version is None else version
        self._forget_unused()  # before the pop: the backward that follows still needs v_f
        v_f = self._in_flight.pop(microbatch)
        self.delays[microbatch] = v_b - v_f
        self._step_delay = max(self._step_delay, v_b - v_f)
        return v_f

    def call(self, weights: Sequence[Tensor], x: Tensor) -> Tensor:
        return functional_call(self.module, dict(zip(self.names, weights)), (x,))

    @torch.no_grad()
    def forward(self, x: Tensor, v_f: int, v_b: int) -> Tensor:
        return self.call(self.forward_weights(v_f, v_b), x)

    def backward(self, x: Tensor, v_f: int, v_b: int, *, grad_out: Tensor | None = None,
                 target: Tensor | None = None, loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
                 scale: int = 1, input_grad: bool = True) -> Tensor | None:
        """Recompute the forward from the stage input `x` at the backward's weights and
        backpropagate: `grad_out` into the output, or (last stage) loss_fn(out, target) / scale.
        Adds to every parameter's `.grad`; returns the gradient of `x` (None when
        `input_grad` is off or `x` takes none, such as token ids)."""
        leaves = [w.detach().requires_grad_(True) for w in self.backward_weights(v_f, v_b)]
        wants_input_grad = input_grad and x.is_floating_point()
        if wants_input_grad:
            x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = self.call(leaves, x)
            if target is not None:  # the loss, scaled as a synchronous step scales it
                out = loss_fn(out, target) / scale
            sources = [x, *leaves] if wants_input_grad else leaves
            grads = torch.autograd.grad(out, sources, grad_outputs=grad_out, allow_unused=True)
        dx = None
        if wants_input_grad:
            dx, grads = grads[0], grads[1:]
        for param, grad in zip(self.params, grads):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad.detach().clone()
            else:
                param.grad += grad
        return dx

    # ---- the optimizer step ----------------------------------------------------------
    def step(self, step: int, *, keep_old: bool | None = None) -> float:
        """Optimizer step `step` (0-based, from the start of training): the learning rate
        with T1's factor for the largest delay since the last step, the step, the new
        version and T2's update. `keep_old`: keep the replaced version frozen (None: when
        the mode stashes and a forward in flight saw it). Returns the factor used."""
        factor = t1_multiplier(self._step_delay, step, self.mode.k)
        self._step_delay = 0
        scheduled = 1.0 if self.lr_factor is None else self.lr_factor(step)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * scheduled * factor
        old_version = self.version
        if keep_old is None:
            keep_old = self.mode.name in STASHING and old_version in self._in_flight.values()
        old = tuple(p.detach().clone() for p in self.params) if keep_old or self.gamma is not None else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version = old_version + 1
        if self.gamma is not None:
            g, new = self.gamma, self.weights(self.version)
            self._delta[self.version] = tuple(
                g * d + (1 - g) * (a - b) for d, a, b in zip(self._delta[old_version], new, old)
            )
        if keep_old:
            self._frozen[old_version] = old
        self._forget_unused()
        self.most_versions = max(self.most_versions, 1 + len(self._frozen))
        return factor

    # ---- checkpoints ------------------------------------------------------------------
    def state(self) -> dict:
        """The mode's state between steps: the version and T2's velocity estimate at it
        (the weights and the optimizer are saved with the module and the optimizer)."""
        if self._in_flight or self._frozen:
            raise RuntimeError(
                f"the stage's state is saved only between Programs (microbatches in flight {sorted(self._in_flight)}, "
                f"versions kept {sorted(self._frozen)}): drain the pipeline first"
            )
        delta = self.delta(self.version)
        return {"version": self.version, "gamma": self.gamma,
                "delta": None if delta is None else [d.detach().clone() for d in delta]}

    def load_state(self, state: dict) -> None:
        """Continue from `state()` of the same mode (after the module and optimizer are loaded)."""
        if (state["gamma"] is None) != (self.gamma is None) or (
                self.gamma is not None and abs(state["gamma"] - self.gamma) > 1e-12 * self.gamma):
            raise ValueError(f"the checkpoint's velocity decay gamma {state['gamma']} is not this run's {self.gamma}: "
                             "resume with the mode, D and p the checkpoint was written with")
        self.version = int(state["version"])
        self._frozen, self._in_flight, self._step_delay = {}, {}, 0
        self._delta = {} if self.gamma is None else {
            self.version: tuple(d.to(p.device, p.dtype) for d, p in zip(state["delta"], self.params))}

    def _forget_unused(self) -> None:
        if self.auto_forget:
            self.forget_before(min(self._in_flight.values(), default=self.version))

    def forget_before(self, version: int) -> None:
        """Drop the kept versions (and velocity estimates) older than `version`."""
        for table in (self._frozen, self._delta):
            for v in [v for v in table if v < version and v != self.version]:
                del table[v]
