"""What an asynchronous training mode is (no torch here; `pipeblocks.train.asynchronous.reference`
runs it; the simulator and the planner price it).

In an asynchronous run (`pipeblocks.schedules.asynchronous`) the forward of microbatch m
at stage s sees the stage's weights of version v_F, and its backward runs when the
stage is at version v_B >= v_F; the delay is tau = v_B - v_F. The forward uses the
weights it finds (w_{v_F}; nesterov looks ahead from them, below); the mode says what
the backward computes with:

    pipedream  w_{v_F}: the weights the forward used, kept as a stash (exact delayed SGD)
    naive      w_{v_B}: the current weights, no correction
    pipemare   w_{v_B} - tau * delta: the current weights moved back along delta, an EMA of
               the stage's weight velocity (T2), and the step size divided by the delay
               at first (T1)
    nesterov   w_{v_B}: the current weights, but the forward looked ahead (below)

T1 (learning-rate rescheduling): at optimizer step t of a stage whose step applies
gradients of delay tau >= 1 (the largest among its microbatches), the learning rate is
lr_t / tau^(1 - min(t/K, 1)), lr_t the run's scheduled rate (warm-up and decay): divided
by the delay at first, back to the schedule after K steps. K = 0 turns T1 off. K is
relative to the run: by default DEFAULT_LR_WARMUP_FRACTION of the steps its schedule is
made for (`for_run`), so every run reaches the end of T1 (docs/pipemare.md, "Defaults").

T2 (discrepancy correction): after every step, delta <- gamma*delta + (1-gamma)*(w_new - w_old)
with gamma = D^(1/tau_s), tau_s the stage's largest delay in the run; the backward of a
microbatch of delay tau runs at w - tau*delta. D = 1 keeps delta at 0: T2 off.

nesterov (a look-ahead for stale gradients, in the spirit of the Nesterov-style method for
asynchronous pipeline parallelism of Ajanthan et al., ICML 2025; this is our own, simpler
definition, not that paper's algorithm): the stage keeps the same velocity EMA delta as T2
(same gamma from D), and the forward of a microbatch that will have delay tau runs at the
look-ahead point w_{v_F} + tau * delta_{v_F}, an extrapolation of where the weights will
be when its backward comes; the backward recomputes at the current weights w_{v_B}. So
forward and backward see nearly the same weights, and the gradient is taken (nearly) at
the weights it is applied to, instead of tau steps behind them. The forward needs only
the current weights and delta (tau is known from the Program): nothing is stashed. Delay 0
or D = 1 (delta stays 0) gives naive. No learning-rate rescaling.

Every mode may start with W synchronous steps (a flush after each: delay 0), then run
asynchronously; T1's t counts those steps too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..ir.program import Program
from .versions import stashed_versions, weight_versions

__all__ = [
    "MODES", "AsyncMode", "DEFAULT_LR_WARMUP_FRACTION", "DEFAULT_DISCREPANCY_DECAY", "default_k", "t1_multiplier",
    "weight_memory", "lookahead",
]

MODES = ("pipedream", "naive", "pipemare", "nesterov")

DEFAULT_LR_WARMUP_FRACTION = 0.25
"""pipemare's K when none is given, as a share of the run (`default_k`): T1 is a correction
for the start of training, so a run spends most of its steps at its own schedule (a fixed
K longer than a short run would divide its rate by the delay to the end)."""
DEFAULT_DISCREPANCY_DECAY = 0.1
"""pipemare's D when none is given: a short EMA, which tracks the recent velocity."""


@dataclass(frozen=True)
class AsyncMode:
    """One asynchronous training mode (see the module doc)."""

    name: str
    """pipedream, naive, pipemare or nesterov"""
    sync_warmup_steps: int = 0
    """W: the first W optimizer steps run synchronously (any mode)"""
    lr_warmup_steps: int | None = None
    """pipemare's K for T1 (None: `default_k` of the run's steps, set by `for_run`; 0: T1 off)"""
    discrepancy_decay: float | None = None
    """D in (0, 1] of the velocity EMA: pipemare's T2, nesterov's look-ahead
    (None: DEFAULT_DISCREPANCY_DECAY; 1: off)"""

    def __post_init__(self) -> None:
        if self.name not in MODES:
            raise ValueError(f"unknown asynchronous mode {self.name!r}: choose one of {', '.join(MODES)}")
        w = self.sync_warmup_steps
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ValueError(f"sync_warmup_steps must be an integer >= 0, got {w!r}")
        if self.name != "pipemare" and self.lr_warmup_steps is not None:
            raise ValueError(f"mode {self.name!r} takes no lr_warmup_steps: that is pipemare's T1")
        if self.name not in ("pipemare", "nesterov") and self.discrepancy_decay is not None:
            raise ValueError(
                f"mode {self.name!r} takes no discrepancy_decay: that is the velocity EMA of pipemare's T2 "
                "and nesterov's look-ahead"
            )
        k = self.lr_warmup_steps
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise ValueError(f"lr_warmup_steps (K) must be an integer >= 0 (0 turns T1 off), got {k!r}")
        d = self.discrepancy_decay
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1):
            raise ValueError(f"discrepancy_decay (D) must be a number in (0, 1] (1 turns T2 off), got {d!r}")

    def describe(self) -> dict:
        """The mode and its resolved settings, as checkpoints record them."""
        return {"mode": self.name, "sync_warmup_steps": self.sync_warmup_steps, "K": self.k, "D": self.d}

    @property
    def resolved(self) -> bool:
        """Whether every setting is known: pipemare's default K needs the run's length (`for_run`)."""
        return self.name != "pipemare" or self.lr_warmup_steps is not None

    def for_run(self, steps: int) -> AsyncMode:
        """This mode for a run whose learning-rate schedule spans `steps` optimizer steps:
        a K not given becomes `default_k(steps)`; given settings are kept."""
        return self if self.resolved else replace(self, lr_warmup_steps=default_k(steps))

    def continuing(self, saved: dict) -> AsyncMode:
        """This mode resuming a checkpoint whose run was `saved` (its `describe()`): the
        settings not given (None) are the checkpoint's, so a resumed run keeps its K and D
        whatever its --steps now. Another mode is left as is (the resume refuses it)."""
        if saved.get("mode") != self.name:
            return self
        k = saved["K"] if self.name == "pipemare" and self.lr_warmup_steps is None else self.lr_warmup_steps
        d = self.discrepancy_decay
        if d is None and self.name in ("pipemare", "nesterov"):
            d = saved["D"]
        return replace(self, lr_warmup_steps=k, discrepancy_decay=d)

    @property
    def k(self) -> int:
        """T1's K (0 outside pipemare: no rescaling)."""
        if self.name != "pipemare":
            return 0
        if self.lr_warmup_steps is None:
            raise ValueError("pipemare's default K is a share of the run's steps: resolve the mode with "
                             "AsyncMode.for_run(steps) first (TrainConfig and replay do), or give lr_warmup_steps")
        return self.lr_warmup_steps

    @property
    def d(self) -> float:
        """The velocity EMA's D (1 outside pipemare and nesterov: no correction)."""
        if self.name not in ("pipemare", "nesterov"):
            return 1.0
        return DEFAULT_DISCREPANCY_DECAY if self.discrepancy_decay is None else float(self.discrepancy_decay)


def default_k(steps: int) -> int:
    """T1's K for a run of `steps` optimizer steps (the steps its learning-rate schedule is
    made for): DEFAULT_LR_WARMUP_FRACTION of them, rounded down, at least 1."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"a run has at least one step, got {steps!r}")
    return max(1, int(steps * DEFAULT_LR_WARMUP_FRACTION))


def t1_multiplier(delay: int, step: int, k: int) -> float:
    """T1's factor on the learning rate at optimizer step `step` (0-based, counted from the
    start of training) for gradients of `delay`: 1 / delay^(1 - min(step/k, 1)) for
    delay >= 1, and 1 for delay 0 or k = 0 (T1 off)."""
    if delay < 0 or step < 0 or k < 0:
        raise ValueError(f"delay ({delay}), step ({step}) and K ({k}) must be >= 0")
    if delay <= 1 or k == 0:
        return 1.0
    return math.pow(delay, -(1.0 - min(step / k, 1.0)))


def lookahead(mode: AsyncMode, delay: int) -> int:
    """How many steps of the velocity EMA the forward of a microbatch of `delay` looks
    ahead: the delay in nesterov (where its backward will find the weights), 0 otherwise."""
    if delay < 0:
        raise ValueError(f"delay must be >= 0, got {delay}")
    return delay if mode.name == "nesterov" else 0


def weight_memory(program: Program, mode: AsyncMode | None) -> tuple[float, ...]:
    """Per rank, the weight-sized buffers `mode` keeps while running `program`, in units of
    one full stage's weights (None: synchronous training, 1 per rank):

        pipedream  every version still in flight: max delay + 1 per stage (stashes)
        naive      the weights only: 1
        pipemare   the weights, and T2's velocity estimate on a stage with delay (2)
        nesterov   the weights, and the same velocity estimate (2)

    Gradients and optimizer state are left out: every mode has the same."""
    schedule = program.schedule
    if mode is None or mode.name == "naive":
        copies = [1] * schedule.num_stages
    elif mode.name == "pipedream":
        copies = list(stashed_versions(program))
    else:
        versions = weight_versions(program)
        copies = [1 + (mode.d < 1 and versions.max_delay(s) >= 1) for s in range(schedule.num_stages)]
    share = schedule.placement.stage_fraction
    return tuple(sum(copies[s] * share for s in schedule.placement.stages_of(r)) for r in range(schedule.p))
