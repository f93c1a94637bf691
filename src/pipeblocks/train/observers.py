"""What both training loops (synchronous and asynchronous) do beside the steps: who writes
the progress lines and `--metrics`, and the held-out evaluation of `--eval-every`.

    >>> metrics = metrics_writer(cfg, setup)              # None on the ranks that do not write
    >>> held = evaluate_if_due(cfg, ctx, setup, done=k + 1, last=cfg.steps)   # every rank takes part

The rank that writes is the one holding the last stage (DualPipe: of its first direction),
of replica 0 and tensor-parallel rank 0. An evaluation is due after every `eval_every`-th
step and after the last; it runs on the weights the stages hold at that moment.
"""
from __future__ import annotations

import contextlib

from .config import TrainConfig
from .evaluate import held_out_loss
from .metrics import MetricsWriter
from .stage_copies import model_stages

__all__ = ["evaluation_due", "evaluate_if_due", "metrics_writer", "writes_progress"]


def writes_progress(cfg: TrainConfig, setup) -> bool:
    """Whether this rank prints the progress lines and writes the metrics: the one holding the
    last stage, of replica 0 (and tensor-parallel rank 0)."""
    last = model_stages(cfg.schedule.schedule) - 1  # DualPipe: the first direction's last stage
    return last in setup.modules and setup.replica == 0 and getattr(setup, "tp_rank", 0) == 0


def metrics_writer(cfg: TrainConfig, setup):
    """The `--metrics` writer of this rank (None without --metrics, under --verify, or on a
    rank that does not write)."""
    if cfg.metrics is None or cfg.verify or not writes_progress(cfg, setup):
        return None
    return MetricsWriter(cfg.metrics, resume=cfg.checkpoint is not None and cfg.checkpoint.resume)


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
