"""The training loop behind `pipeblocks train`: one process per pipeline rank.

    >>> cfg, data = prepare(ScheduleRequest(name="1f1b", m=4, mesh=Mesh(pp=2)), model=GPTConfig(layers=4), steps=20)
    >>> results = launch(cfg)       # p local processes (or this one, under torchrun); one RankResult per rank

The loop is `_train_rank`: one `SyncSteps.run` per step (the synchronous step strategy,
steps_sync.py: the rank's own stages, with the weights of the whole model of the same seed,
an AdamW and a `PipelineRunner`; step k feeds the batch `TokenWindows.batch(k, m*b, seed)`),
then the observers both loops share (observers.py: progress line, evaluation, metrics,
checkpoint when due; the asynchronous loop is asynchronous/rank.py). The rank that holds
the last stage prints one progress line per step. The optimizer steps through a `PostValidator`
(post_validation.py): `clip_grad` clips by the global gradient norm, and a step whose
gradient is non-finite on any rank is skipped on every rank, with no barrier before the
step. Checkpoints go to `cfg.checkpoint.directory` every `save_every` steps and after the last one
(see checkpoint.py); `resume` continues from the newest step intact on every rank (each
rank verifies its own files, then the ranks agree). With data parallelism or sharding
they go through torch.distributed.checkpoint instead (sharded_checkpoint.py), loadable at
another dp size. `launch` refuses a directory holding another run's checkpoints unless
`overwrite`.

A run that stops early saves too: on a stop request (SIGTERM, SIGINT or SIGHUP, see
pipeblocks.runtime.lifecycle) every rank stops after the same step and saves it; a rank
that fails or is interrupted saves its last completed step on the way out (its weights,
optimizer and RNG as they were after that step), when it still can.

Rank 0 also collects the measured Timeline of every step (one gather per step) and
returns the latest ones, from which the launcher profiles pass times and the bubble
(report.py).
"""
from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch

from . import checkpoint as ckpt
from . import sharded_checkpoint as sharded
from .config import TrainConfig
from .export_hf import save_rank_part
from .observers import claim_checkpoints, evaluate_if_due, metrics_writer, progress_line, save_when_due
from .report import RankResult
from .sharded_checkpoint import uses_sharded_checkpoints
from .steps_sync import SyncSteps, chunk_optimizers

__all__ = ["TrainConfig", "checkpoint_note", "launch", "launch_or_report", "train_rank", "uses_sharded_checkpoints"]

T = TypeVar("T")

KEEP_TIMELINES = 32
"""Rank 0 returns the measured timelines of at most this many of the latest steps."""
MEMORY_STEPS = 3
"""Saved-activation bytes are counted on this many first steps and on the last (whose
timeline the report draws); the hooks cost 10-30% of a small CPU step."""


def launch(cfg: TrainConfig) -> list[RankResult] | None:
    """Run `cfg` in p x dp x tp processes: local ones (gloo on CPU, NCCL on CUDA), or, under
    torchrun, this process as its rank. A failure on any rank raises here. Returns every
    rank's result, on the launching process (rank 0 under torchrun; None on the others)."""
    from ..runtime.launch import run_here, spawn, under_torchrun
    from ..runtime.mesh import check_world_size

    torchrun = under_torchrun()
    if not torchrun or reporting_process():
        claim_checkpoints(cfg, lambda directory: sharded.claim_sharded(directory, overwrite=cfg.checkpoint.overwrite))
    world = cfg.world_size
    check_world_size(cfg.schedule.p, cfg.dp, world, cfg.tp)
    if torchrun:
        return run_here(train_rank, args=(cfg,), world_size=world, timeout_s=cfg.timeout_s, device=cfg.mesh.device,
                        threads_per_rank=cfg.mesh.threads_per_rank)
    return spawn(
        train_rank, world, args=(cfg,), timeout_s=cfg.timeout_s, threads_per_rank=cfg.threads_for(world),
        schedule=None if cfg.data_parallel or cfg.tp > 1 else cfg.schedule.schedule, device=cfg.mesh.device,
    )


def reporting_process() -> bool:
    """Whether this process prints the run's header and report: the launcher, or global rank
    0 under torchrun."""
    import os

    from ..runtime.launch import under_torchrun

    return not under_torchrun() or os.environ.get("RANK") == "0"


def train_rank(ctx, cfg: TrainConfig) -> RankResult:
    """The body of one rank (`ctx` is the runtime's DistContext)."""
    last_good = _LastGood()
    try:
        return _train_rank(ctx, cfg, last_good)
    except BaseException:
        last_good.save_on_the_way_out(cfg, ctx.control)
        raise


def _train_rank(ctx, cfg: TrainConfig, last_good: _LastGood) -> RankResult:
    """The synchronous loop: one `SyncSteps.run` per step, then the observers (progress line,
    evaluation, metrics, checkpoint) in that order."""
    steps = SyncSteps(ctx, cfg, last_good)
    setup, start, control, runner = steps.setup, steps.start, ctx.control, steps.runner
    rank, replica, dp = setup.rank, setup.replica, setup.data_parallel
    link = _dp_link(cfg, setup)
    # a DCP save is a collective: a failing rank cannot take part, so none is saved on the way out
    last_good.track(rank, None if uses_sharded_checkpoints(cfg) else setup.modules, steps.optimizer,
                    cfg.meta(setup.data.source), start)
    control.step_done(start)
    last = start + 1 if cfg.verify else cfg.steps
    losses, spans, peak, skipped, dp_waits, evals = [], [], 0, [], [], []
    metrics = metrics_writer(cfg, setup)
    timelines: deque = deque(maxlen=KEEP_TIMELINES)
    for step in range(start, last):
        runner.measure_memory = step < start + MEMORY_STEPS or step == last - 1
        done = steps.run(step)
        result, loss, check = done.result, done.loss, done.check
        if cfg.verify:
            return steps.verify_result(step, done)
        if check is not None and check.outcome == "skipped":
            skipped.append(step)
        if dp is not None:
            dp_waits.append(dp.wait_s)
        spans.append((step, done.t0, done.t1))
        peak = max(peak, result.peak_saved_bytes or 0)
        if result.timeline is not None:
            timelines.append((step, result.timeline))
        if loss is not None:
            losses.append((step, loss))
            if not cfg.quiet and replica == 0 and setup.tp_rank == 0:
                progress_line(cfg, step, "emulated" if cfg.emulation else f"{loss:.4f}", done.t1 - done.t0,
                              "" if check is None else _check_note(check, cfg.clip_grad))
        held = evaluate_if_due(cfg, ctx, setup, step + 1, last)
        if held is not None:
            evals.append((step, held))
        if metrics is not None and loss is not None:
            metrics.write(step=step + 1, loss=loss, lr=cfg.lr_at(step), step_time_s=done.t1 - done.t0,
                          tokens=cfg.tokens_per_step, rank=rank, eval_loss=held,
                          activation_bytes=result.peak_saved_bytes or None, static_bytes=steps.static,
                          device_max_bytes=_device_max_bytes(ctx.device))
        stop = control.step_done(step + 1)  # True on every rank after the same step
        if save_when_due(cfg, control, step + 1, lambda k: _save(cfg, setup, steps.optimizer, k),
                         final=stop or step + 1 == last):
            last_good.saved = step + 1
        if stop:
            break
    if cfg.save_hf is not None and spans and spans[-1][0] + 1 == cfg.steps:
        with control.critical():
            save_rank_part(cfg, setup)  # every rank: the gathers of sharded stages are collectives
        control.beat()
    sys.stdout.flush()
    # the optimizer state exists from the second step on: the steady-state peak
    predicted = steps.static_predicted[1] if len(spans) > 1 else steps.static_predicted[0]
    return RankResult(rank, tuple(setup.modules), tuple(losses), tuple(spans), peak, tuple(timelines),
                      skipped_steps=tuple(skipped), dp_rank=replica, static_bytes_measured=steps.static,
                      static_bytes_predicted=predicted, dp_wait_s=tuple(dp_waits), dp_link=link,
                      eval_losses=tuple(evals), tp_rank=setup.tp_rank)


def _device_max_bytes(device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda" else None


def _dp_link(cfg: TrainConfig, setup) -> tuple[float, float] | None:
    """The DP link the report's simulated column models: the emulated one, or one measured
    on the dp group (with replicas, outside --verify)."""
    if cfg.emulation is not None and cfg.emulation.link is not None:
        return cfg.emulation.link
    if setup.mesh is not None and cfg.dp > 1 and not cfg.verify:
        from ..runtime.data_parallel import measure_link

        return measure_link(setup.mesh.dp_group)
    return None


def _save(cfg: TrainConfig, setup, optimizer, done: int) -> None:
    """Save step `done` of this rank (through torch.distributed.checkpoint when sharded)."""
    directory, meta = cfg.checkpoint.directory, cfg.meta(setup.data.source)
    if uses_sharded_checkpoints(cfg):
        sharded.save_sharded(directory, step=done, stages=setup.modules, optimizers=chunk_optimizers(optimizer),
                             meta=meta)
    else:
        ckpt.save_rank(directory, rank=setup.rank, step=done, stages=setup.modules, optimizer=optimizer, meta=meta)


def _check_note(check, clip_grad: float | None) -> str:
    if check.outcome == "skipped":
        return "  skipped (non-finite gradient)"
    if clip_grad is None:
        return ""
    return f"  norm {check.norm:.3g}" + (" clipped" if check.outcome == "clipped" else "")


class _LastGood:
    """This rank's state after its last completed step, to save when the rank fails mid-step:
    until the next optimizer step the parameters and optimizer state are still those of
    that step; only the RNG may have moved on, so it is kept."""

    def __init__(self) -> None:
        self.done = self.saved = 0
        self.rank, self.stages, self.optimizer, self.meta, self.rng = 0, None, None, None, None

    def track(self, rank: int, stages, optimizer, meta: dict, start: int) -> None:
        self.rank, self.stages, self.optimizer, self.meta = rank, stages, optimizer, meta
        self.stepped(start)
        self.saved = start

    def stepped(self, done: int) -> None:
        self.done, self.rng = done, torch.get_rng_state()

    def save_on_the_way_out(self, cfg: TrainConfig, control) -> None:
        """Save the last completed step if it is newer than the last save; a failing save
        is reported and must not hide the error that stopped the rank."""
        if cfg.checkpoint is None or self.stages is None or self.done <= self.saved:
            return
        with control.critical():
            try:
                torch.set_rng_state(self.rng)
                ckpt.save_rank(cfg.checkpoint.directory, rank=self.rank, step=self.done, stages=self.stages,
                               optimizer=self.optimizer, meta=self.meta)
                print(f"rank {self.rank}: saved step {self.done} to {cfg.checkpoint.directory} on the way out",
                      file=sys.stderr, flush=True)
            except Exception as err:  # noqa: BLE001 - reported; the original error goes on
                print(f"rank {self.rank}: could not save step {self.done} on the way out: {err}",
                      file=sys.stderr, flush=True)


def launch_or_report(start: Callable[[], T], note: Callable[[], str] | None = None) -> T | None:
    """`start()` (a launch of the ranks). A rank that failed or a run that made no progress is
    reported on stderr, followed by `note()` (asked after the failure, so it can say what the
    run left behind), and gives None; a run stopped by a signal exits with 128 + the signal,
    the shell's convention for a signalled process."""
    from ..runtime import RankFailedError, RunStoppedError

    try:
        return start()
    except (RankFailedError, TimeoutError, RunStoppedError) as err:
        print(f"pipeblocks train: {err}" + (f"\npipeblocks train: {note()}" if note else ""), file=sys.stderr)
        if isinstance(err, RunStoppedError):
            raise SystemExit(128 + err.signal) from None
        return None


def checkpoint_note(cfg: TrainConfig) -> str:
    """One line for a run that ended early: what its checkpoint directory now resumes from (an
    asynchronous run's checkpoints are drained steps)."""
    drained = cfg.async_mode is not None
    if cfg.checkpoint is None:
        return ("no checkpoint was written: give --checkpoint DIR to drain and save when an asynchronous run stops"
                if drained else "no checkpoint was written: give --checkpoint DIR to save when a run stops")
    directory = cfg.checkpoint.directory
    if uses_sharded_checkpoints(cfg):
        step = sharded.latest_sharded_step(directory)
        if step is None:
            return f"no complete data-parallel checkpoint in {directory}"
        return f"checkpoint: step {step} is complete in {directory}: continue with --resume"
    step = ckpt.latest_step(directory, cfg.schedule.p)
    if step is None:
        return f"no step was saved by every rank in {directory}"
    return f"checkpoint: every rank has {'drained ' if drained else ''}step {step} in {directory}: continue with --resume"


