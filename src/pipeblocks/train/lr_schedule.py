"""The learning rate of every optimizer step: warm-up, then constant, cosine or linear decay.

    >>> s = LRSchedule("cosine", lr=3e-3, warmup_steps=4, min_lr=3e-4, total_steps=40)
    >>> [round(s.rate(t), 6) for t in (0, 3, 4, 39)]      # step t is 0-based
    [0.0006, 0.0024, 0.003, 0.0003]
    >>> s = resolve_schedule(None, lr=3e-3, warmup_steps=None, min_lr=None, steps=40)   # a fresh run's default
    >>> s.describe()
    'cosine 0.003 -> 0.0003 over 40 steps (4 warm-up)'

Warm-up: step t < W runs at lr * (t + 1) / (W + 1), a straight line up to the peak (the
peak itself is first reached at step W). After it, over the steps W .. total-1:

    constant  lr
    cosine    min_lr + (lr - min_lr) * (1 + cos(pi * f)) / 2
    linear    lr - (lr - min_lr) * f

with f = (t - W) / (total - 1 - W) from 0 to 1; steps past the schedule's end (a resumed
run given more --steps than the schedule was made for) run at min_lr.

A fresh run's default (`resolve_schedule` with nothing given) is cosine from lr to lr/10
with a warm-up of a tenth of the run (at most DEFAULT_WARMUP_CAP steps), at a peak rate
`default_lr(hidden)` that shrinks with the model's width: AdamW's first steps move every
weight by about lr, so at a constant 3e-3 the built-in models at hidden 1024 climb from
5.4 to 6.2-7.0 before they come down, where the defaults descend from the first steps
(docs/training.md has the figures). The schedule, horizon included, is part of the run's
description in every checkpoint, so a resumed run continues it exactly.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = [
    "DEFAULT_LR", "DEFAULT_LR_SCHEDULE", "DEFAULT_LR_WIDTH", "DEFAULT_MIN_LR_RATIO", "DEFAULT_WARMUP_CAP", "DEFAULT_WARMUP_FRACTION", "LR_SCHEDULES",
    "LRSchedule", "default_lr", "resolve_schedule",
]

DEFAULT_LR = 3e-3
"""the default peak rate of models up to DEFAULT_LR_WIDTH wide"""
DEFAULT_LR_WIDTH = 128
"""wider models get DEFAULT_LR * DEFAULT_LR_WIDTH / hidden (Adam's step on a width-h layer moves
its output about h times the rate: 3.75e-4 at hidden 1024, near GPT-3's 3e-4 there)"""

LR_SCHEDULES = ("constant", "cosine", "linear")
DEFAULT_LR_SCHEDULE = "cosine"
DEFAULT_MIN_LR_RATIO = 0.1
"""a decaying schedule's default end: lr / 10"""
DEFAULT_WARMUP_FRACTION = 0.1
"""the default warm-up: this share of the run's steps"""
DEFAULT_WARMUP_CAP = 100
"""and at most this many steps"""


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate per optimizer step (see the module doc)."""

    kind: str = "constant"
    lr: float = 3e-3
    """the peak rate"""
    warmup_steps: int = 0
    min_lr: float | None = None
    """where cosine and linear end (None: lr); constant ignores it"""
    total_steps: int = 1
    """the steps the schedule is made for (--lr-decay-steps, default --steps): the decay ends
    at step total_steps - 1"""

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"--lr-schedule {self.kind!r}: choose one of {', '.join(LR_SCHEDULES)}")
        for name, value in (("--lr", self.lr), ("--min-lr", self.min_lr)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0 or (name == "--lr" and value == 0)):
                raise ValueError(f"{name} {value!r}: give a finite rate > 0" + (" (or 0)" if name == "--min-lr" else ""))
        total, w = self.total_steps, self.warmup_steps
        if not isinstance(total, int) or isinstance(total, bool) or total < 1:
            raise ValueError(f"the schedule's total_steps must be an integer >= 1, got {total!r}")
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ValueError(f"--warmup-steps {w!r}: give an integer >= 0")
        if w and w >= total:
            raise ValueError(f"--warmup-steps {w} leaves no step at the peak rate of a schedule of {total} steps "
                             f"(--steps, or --lr-decay-steps): give a warm-up below {total} (0 .. {total - 1}) or "
                             "raise --steps")
        if self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr:g} is above --lr {self.lr:g}: the schedule decays from --lr "
                             "down to --min-lr; give a smaller --min-lr")

    @property
    def end_lr(self) -> float:
        return self.lr if self.kind == "constant" or self.min_lr is None else self.min_lr

    def rate(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based, from the run's start)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        w = self.warmup_steps
        if step < w:
            return self.lr * (step + 1) / (w + 1)
        if self.kind == "constant":
            return self.lr
        span = self.total_steps - 1 - w  # the decay's steps after the peak
        f = min(1.0, (step - w) / span) if span > 0 else float(step > w)
        low = self.end_lr
        if self.kind == "cosine":
            return low + (self.lr - low) * 0.5 * (1.0 + math.cos(math.pi * f))
        return self.lr - (self.lr - low) * f

    def factor(self, step: int) -> float:
        """rate(step) / lr: what a stage's base rate is multiplied by (asynchronous training)."""
        return self.rate(step) / self.lr

    def describe(self) -> str:
        if self.kind == "constant":
            body = f"constant {self.lr:g}"
        else:
            body = f"{self.kind} {self.lr:g} -> {self.end_lr:g} over {self.total_steps} steps"
        return body + (f" ({self.warmup_steps} warm-up)" if self.warmup_steps else "")

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> LRSchedule:
        return LRSchedule(**data)


def default_lr(hidden: int) -> float:
    """The default peak rate for a model of width `hidden`: 3e-3 up to 128, then 3e-3 * 128 / hidden."""
    return DEFAULT_LR * min(1.0, DEFAULT_LR_WIDTH / hidden)


def resolve_schedule(kind: str | None, *, lr: float, warmup_steps: int | None, min_lr: float | None, steps: int,
                     decay_steps: int | None = None, saved: dict | None = None) -> LRSchedule:
    """The schedule of a run of `steps` steps from the command line's options (None: not
    given). `decay_steps`: the steps the schedule is made for (None: `steps`); a run that
    will be continued to more steps later gives the whole length here. `saved`: the
    schedule a resumed checkpoint carries; it is continued as it was, and an option given
    now that disagrees with it is refused (one line, naming both)."""
    if saved is not None:
        schedule = LRSchedule.from_json(saved)
        given = {"--lr-schedule": (kind, schedule.kind), "--warmup-steps": (warmup_steps, schedule.warmup_steps),
                 "--min-lr": (min_lr, schedule.min_lr), "--lr": (lr, schedule.lr),
                 "--lr-decay-steps": (decay_steps, schedule.total_steps)}
        clash = [f"{flag} {now} (the checkpoint's: {then})" for flag, (now, then) in given.items()
                 if now is not None and now != then]
        if clash:
            raise ValueError(f"--resume continues the checkpoint's learning-rate schedule ({schedule.describe()}) but "
                             f"{', '.join(clash)} differ(s): drop these options, or start a new run")
        return schedule
    kind = kind or DEFAULT_LR_SCHEDULE
    if kind == "constant" and min_lr is not None:
        raise ValueError(f"--min-lr {min_lr:g} with --lr-schedule constant has no effect: drop --min-lr, or choose "
                         "--lr-schedule cosine or linear")
    total = steps if decay_steps is None else decay_steps
    if warmup_steps is None:  # a tenth of the schedule's steps, at most DEFAULT_WARMUP_CAP (0 under 10 steps)
        warmup_steps = min(DEFAULT_WARMUP_CAP, int(total * DEFAULT_WARMUP_FRACTION))
    if kind != "constant" and min_lr is None and lr is not None and math.isfinite(lr):
        min_lr = lr * DEFAULT_MIN_LR_RATIO
    return LRSchedule(kind, lr, warmup_steps, min_lr, total)
