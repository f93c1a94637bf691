"""What an asynchronous training mode is (no torch here; `async_reference.py` runs it).

In an asynchronous run (`pipeblocks.schedules.asynchronous`) the forward of microbatch m
at stage s sees the stage's weights of version v_F, and its backward runs when the
stage is at version v_B >= v_F; the delay is tau = v_B - v_F. The forward always uses
the weights it finds (w_{v_F}); the mode says what the backward computes with:

    pipedream  w_{v_F}: the weights the forward used, kept as a stash (exact delayed SGD)
    naive      w_{v_B}: the current weights, no correction
    pipemare   w_{v_B} - tau * delta: the current weights moved back along delta, an EMA of
               the stage's weight velocity (T2), and the step size divided by the delay
               at first (T1)

T1 (learning-rate rescheduling): at optimizer step t of a stage whose step applies
gradients of delay tau >= 1 (the largest among its microbatches), the learning rate is
lr / tau^(1 - min(t/K, 1)): divided by the delay at first, back to lr after K steps.
K = 0 turns T1 off.

T2 (discrepancy correction): after every step, delta <- gamma*delta + (1-gamma)*(w_new - w_old)
with gamma = D^(1/tau_s), tau_s the stage's largest delay in the run; the backward of a
microbatch of delay tau runs at w - tau*delta. D = 1 keeps delta at 0: T2 off.

Every mode may start with W synchronous steps (a flush after each: delay 0), then run
asynchronously; T1's t counts those steps too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.program import Program
from ..core.versions import stashed_versions, weight_versions

__all__ = [
    "MODES", "AsyncMode", "DEFAULT_LR_WARMUP_STEPS", "DEFAULT_DISCREPANCY_DECAY", "t1_multiplier", "weight_memory",
]

MODES = ("pipedream", "naive", "pipemare")

DEFAULT_LR_WARMUP_STEPS = 100
"""pipemare's K when none is given: T1 anneals over the first 100 optimizer steps."""
DEFAULT_DISCREPANCY_DECAY = 0.1
"""pipemare's D when none is given: a short EMA, which tracks the recent velocity."""


@dataclass(frozen=True)
class AsyncMode:
    """One asynchronous training mode (see the module doc)."""

    name: str
    """pipedream, naive or pipemare"""
    sync_warmup_steps: int = 0
    """W: the first W optimizer steps run synchronously (any mode)"""
    lr_warmup_steps: int | None = None
    """pipemare's K for T1 (None: DEFAULT_LR_WARMUP_STEPS; 0: T1 off)"""
    discrepancy_decay: float | None = None
    """pipemare's D in (0, 1] for T2 (None: DEFAULT_DISCREPANCY_DECAY; 1: T2 off)"""

    def __post_init__(self) -> None:
        if self.name not in MODES:
            raise ValueError(f"unknown asynchronous mode {self.name!r}: choose one of {', '.join(MODES)}")
        w = self.sync_warmup_steps
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ValueError(f"sync_warmup_steps must be an integer >= 0, got {w!r}")
        if self.name != "pipemare" and (self.lr_warmup_steps is not None or self.discrepancy_decay is not None):
            raise ValueError(
                f"mode {self.name!r} takes no lr_warmup_steps or discrepancy_decay: those are pipemare's T1 and T2"
            )
        k = self.lr_warmup_steps
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise ValueError(f"lr_warmup_steps (K) must be an integer >= 0 (0 turns T1 off), got {k!r}")
        d = self.discrepancy_decay
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1):
            raise ValueError(f"discrepancy_decay (D) must be a number in (0, 1] (1 turns T2 off), got {d!r}")

    @property
    def k(self) -> int:
        """T1's K (0 outside pipemare: no rescaling)."""
        if self.name != "pipemare":
            return 0
        return DEFAULT_LR_WARMUP_STEPS if self.lr_warmup_steps is None else self.lr_warmup_steps

    @property
    def d(self) -> float:
        """T2's D (1 outside pipemare: no correction)."""
        if self.name != "pipemare":
            return 1.0
        return DEFAULT_DISCREPANCY_DECAY if self.discrepancy_decay is None else float(self.discrepancy_decay)


def t1_multiplier(delay: int, step: int, k: int) -> float:
    """T1's factor on the learning rate at optimizer step `step` (0-based, counted from the
    start of training) for gradients of `delay`: 1 / delay^(1 - min(step/k, 1)) for
    delay >= 1, and 1 for delay 0 or k = 0 (T1 off)."""
    if delay < 0 or step < 0 or k < 0:
        raise ValueError(f"delay ({delay}), step ({step}) and K ({k}) must be >= 0")
    if delay <= 1 or k == 0:
        return 1.0
    return math.pow(delay, -(1.0 - min(step / k, 1.0)))


def weight_memory(program: Program, mode: AsyncMode | None) -> tuple[float, ...]:
    """Per rank, the weight-sized buffers `mode` keeps while running `program`, in units of
    one full stage's weights (None: synchronous training, 1 per rank):

        pipedream  every version still in flight: max delay + 1 per stage (stashes)
        naive      the weights only: 1
        pipemare   the weights, and T2's velocity estimate on a stage with delay (2)

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
