"""What the training loop does beside the steps, for either step strategy (synchronous or
asynchronous): the progress lines and `--metrics` (`Progress`), the held-out evaluation of
`--eval-every`, and when a checkpoint is due.

    >>> progress = Progress(cfg, setup)                   # prints and writes on one rank only
    >>> progress.step(k, loss, seconds, lr=cfg.lr_at(k))  # after step k (0-based)
    >>> held = evaluate_if_due(cfg, ctx, setup, done=k + 1, last=cfg.steps)   # every rank takes part
    >>> progress.evaluated(k + 1, held)                   # the step's metrics line carries eval_loss

The rank that writes is the one holding the last stage (DualPipe: of its first direction),
of replica 0 and tensor-parallel rank 0. An evaluation is due after every `eval_every`-th
step and after the last; it runs on the weights the stages hold at that moment.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

from .config import TrainConfig
from . import checkpoint as ckpt
from .evaluate import held_out_loss
from .metrics import MetricsWriter
from .sharded_checkpoint import claim_sharded
from .stage_copies import model_stages

__all__ = ["Progress", "claim_checkpoints", "evaluation_due", "evaluate_if_due", "save_when_due", "writes_progress"]


def writes_progress(cfg: TrainConfig, setup) -> bool:
    """Whether this rank prints the progress lines and writes the metrics: the one holding the
    last stage, of replica 0 (and tensor-parallel rank 0)."""
    last = model_stages(cfg.schedule.schedule) - 1  # DualPipe: the first direction's last stage
    return last in setup.modules and setup.replica == 0 and getattr(setup, "tp_rank", 0) == 0


def evaluation_due(cfg: TrainConfig, done: int, last: int) -> bool:
    """Whether the held-out loss is evaluated after step `done` (1-based) of a run ending at `last`."""
    return bool(cfg.eval_every) and not cfg.verify and (done % cfg.eval_every == 0 or done == last)


def evaluate_if_due(cfg: TrainConfig, ctx, setup, done: int, last: int) -> float | None:
    """After every `eval_every`-th step and the last: the held-out loss (on the rank holding
    the last stage; None elsewhere and between evaluations). Every rank takes part."""
    if not evaluation_due(cfg, done, last):
        return None
    batch = setup.held_out.eval_batch(cfg.batch_size)
    with setup.copies if setup.copies is not None else contextlib.nullcontext():
        loss = held_out_loss(setup.runner_stages, setup.loss_fn, cfg.schedule.placement, rank=setup.rank, batch=batch,
                             microbatches=cfg.schedule.m, group=setup.pp_group, device=ctx.device,
                             num_stages=model_stages(cfg.schedule.schedule))  # DualPipe: the first direction
    ctx.control.beat()
    if loss is not None and not cfg.quiet and writes_progress(cfg, setup):
        print(f"eval {done:>5}/{cfg.steps}  held-out loss {loss:.4f}", flush=True)
    return loss


class Progress:
    """The progress lines and `--metrics` of the rank that writes them (`writes_progress`), one
    per optimizer step. The metrics line of a step the held-out loss is evaluated after waits
    for it (`evaluated`), so it carries `eval_loss`."""

    def __init__(self, cfg: TrainConfig, setup) -> None:
        self.cfg, self.rank, self.on = cfg, setup.rank, writes_progress(cfg, setup)
        # --metrics: on the rank that writes, outside --verify
        self.metrics = (MetricsWriter(cfg.metrics, resume=cfg.checkpoint is not None and cfg.checkpoint.resume)
                        if cfg.metrics is not None and not cfg.verify and self.on else None)
        self.pending: dict | None = None

    def step(self, step: int, loss: float | None, seconds: float, note: str = "", **measured) -> None:
        """Step `step` (0-based) took `seconds`: its line and its metrics (`measured`: the
        learning rate, and what else `MetricsWriter.write` takes)."""
        if not self.on:
            return
        cfg = self.cfg
        if self.metrics is not None:
            self._flush()
            self.pending = {"step": step + 1, "loss": loss, "step_time_s": seconds, "tokens": cfg.tokens_per_step,
                            "rank": self.rank, **measured}
            if not evaluation_due(cfg, step + 1, cfg.steps):
                self._flush()
        if not (cfg.quiet or cfg.verify):
            shown = "emulated" if cfg.emulation is not None or loss is None else f"{loss:.4f}"
            print(f"step {step + 1:>5}/{cfg.steps}  loss {shown}  {cfg.tokens_per_step / seconds:>9,.0f} tokens/s  "
                  f"{seconds * 1e3:7.1f} ms{note}", flush=True)

    def evaluated(self, done: int, loss: float | None) -> None:
        """The held-out loss after step `done` (None: none was evaluated) joins that step's metrics line."""
        if self.pending is not None and self.pending["step"] == done:
            self._flush(eval_loss=loss)

    def _flush(self, eval_loss: float | None = None) -> None:
        if self.pending is not None:
            self.metrics.write(**self.pending, eval_loss=eval_loss)
            self.pending = None

    def note(self, text: str) -> None:
        """A line on stderr, from the rank that writes the progress."""
        if self.on:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.metrics is not None:
            self._flush()
            self.metrics.close()


def claim_checkpoints(cfg: TrainConfig) -> None:
    """Before a fresh run: take `--checkpoint DIR` (refused if it holds another run's files, of
    either format, unless --overwrite)."""
    ck = cfg.checkpoint
    if ck is None or ck.resume or cfg.verify:
        return
    removed = (ckpt.claim_directory(ck.directory, overwrite=ck.overwrite)
               + claim_sharded(ck.directory, overwrite=ck.overwrite))
    if removed:
        print(f"--overwrite: removed {len(removed)} checkpoint file(s) of an earlier run from {ck.directory!r}",
              file=sys.stderr, flush=True)


def save_when_due(cfg: TrainConfig, control, done: int, save: Callable[[int], None], *, final: bool) -> bool:
    """Run `save(done)` (uninterruptible) at the run's last step, at a stop (`final`), and every
    `save_every` steps; whether it saved."""
    ck = cfg.checkpoint
    if ck is None or not (final or (ck.save_every and done % ck.save_every == 0)):
        return False
    with control.critical():
        save(done)
    control.beat()
    return True
