"""What `train.run.prepare` resolves for the loop: the learning-rate schedule, the held-out
split, evaluation and the metrics file, for a fresh run or from the checkpoint a run resumes.

    >>> options, data = resolve_loop_options({"steps": 40, "lr_schedule": None, ...}, full_data,
    ...                                      checkpoint=None, resume=False, emulate=None, p=2, async_mode=None)

The options given as None take their defaults: a fresh run gets `lr_schedule.default_lr` for
the model's width as its peak rate, `lr_schedule.resolve_schedule`'s cosine with warm-up, and
holds out DEFAULT_HELD_OUT of the data; a resumed run continues what its
checkpoint records (the schedule, horizon included, the held-out share, and the
asynchronous mode's K and D when not given; a checkpoint written before schedules existed
continues at a constant rate). A fresh pipemare run's K is resolved by `TrainConfig`
against the schedule's horizon. Every refusal is one line,
raised before anything starts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .config import TrainConfig
from .lr_schedule import default_lr, resolve_schedule

if TYPE_CHECKING:  # torch enters when a run starts (data), not when the command line is parsed
    from ..data import TokenWindows

__all__ = ["DEFAULT_HELD_OUT", "resolve_loop_options", "resumed_meta"]

DEFAULT_HELD_OUT = 0.05
"""the share of the data, at its end, that a run holds out (and never trains on) by default"""


def resolve_loop_options(options: dict, data: TokenWindows, *, checkpoint: str | None, resume: bool,
                         emulate: object | None, p: int, hidden: int, async_mode=None) -> tuple[dict, TokenWindows]:
    """(the TrainConfig options with the rate, the schedule and the split resolved, the
    training windows). `hidden`: the model's width, for the default rate."""
    options = dict(options)
    kind, warmup, min_lr, decay = (options.pop(k, None) for k in ("lr_schedule", "warmup_steps", "min_lr",
                                                                   "lr_decay_steps"))
    held_out = options.pop("held_out", None)
    steps, lr = options.get("steps", TrainConfig.steps), options.get("lr")
    saved = None
    if resume and checkpoint:
        saved = resumed_meta(checkpoint)
        if saved is not None:
            if async_mode is not None and saved.get("async"):  # the settings not given now are the checkpoint's
                async_mode = options["async_mode"] = async_mode.continuing(saved["async"])
            # a fresh run's defaults, for the comparison (a mode continuing its checkpoint is resolved)
            fresh = None if async_mode is None else async_mode.for_run(steps if decay is None else decay)
            check_same_kind(saved, checkpoint, p=p, async_mode=fresh)
    if lr is None:  # not given: the checkpoint's, or the default for the model's width
        lr = saved["lr"] if saved is not None and "lr" in saved else default_lr(hidden)
    options["lr"] = lr
    if saved is not None and "lr_schedule" not in saved and kind is warmup is min_lr is decay is None:
        options["lr_schedule"] = None  # written before schedules: it ran at a constant rate, and goes on so
    else:
        options["lr_schedule"] = resolve_schedule(kind, lr=lr, warmup_steps=warmup, min_lr=min_lr, steps=steps,
                                                  decay_steps=decay,
                                                  saved=None if saved is None else saved.get("lr_schedule"))
    if held_out is None:
        held_out = DEFAULT_HELD_OUT if saved is None else saved.get("held_out", 0.0)
    train, held = data.split(held_out)
    every = options.get("eval_every") or 0
    if every:  # what --eval-every composes with is composition.REFUSALS'; here what the data holds
        if held is None:
            tail = data.num_tokens - train.num_tokens
            raise ValueError(
                f"--eval-every {every}: the held-out share {held_out:g} of {data.source} is {tail} tokens, fewer than one "
                f"window of {data.seq + 1}: raise --held-out, give more data (--data) or a shorter --seq"
            )
    options["held_out"] = held_out
    return options, train


def resumed_meta(directory: str) -> dict | None:
    """The run description of the newest checkpoint in `directory` (rank 0's per-rank file,
    or a data-parallel checkpoint's marker); None when there is none to read (the resume's
    own checks then say why)."""
    from . import checkpoint as ckpt  # torch (checkpoints are torch files): only on --resume
    from . import sharded_checkpoint as sharded

    try:
        if sharded.has_sharded(directory):
            step = sharded.latest_sharded_step(directory)
            return None if step is None else sharded.read_marker(directory, step)["meta"]
        intact = ckpt.verify_rank(directory, 0).intact
        return ckpt.load_rank(directory, rank=0, step=intact[-1])["meta"] if intact else None
    except (OSError, ValueError, KeyError):
        return None


def check_same_kind(saved: dict, directory: str, *, p: int, async_mode) -> None:
    """One line when a resume mixes synchronous and asynchronous training, or continues an
    asynchronous run with another mode or another p."""
    now = async_mode.describe() if async_mode is not None else None
    then = saved.get("async")
    if then is None and now is None:
        return

    def run_text(mode: dict | None, ranks) -> str:
        if mode is None:
            return f"synchronous training with p={ranks}"
        return f"--async {mode['mode']} with p={ranks} (W={mode['sync_warmup_steps']}, K={mode['K']}, D={mode['D']})"

    if then != now or saved.get("p") != p:
        raise ValueError(
            f"--resume: the checkpoint in {directory!r} was written by {run_text(then, saved.get('p'))}; this run is "
            f"{run_text(now, p)}: resume with the checkpoint's mode and -p, or use a new --checkpoint directory"
        )
