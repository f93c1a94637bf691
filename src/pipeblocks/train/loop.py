"""The training loop behind `pipeblocks train`: one process per pipeline rank.

    >>> cfg, data = prepare(ScheduleRequest(name="1f1b", m=4, mesh=Mesh(pp=2)), model=GPTConfig(layers=4), steps=20)
    >>> results = launch(cfg)       # p local processes (or this one, under torchrun); one RankResult per rank

The loop is `run_loop`, over one of two step strategies: `SyncSteps` (steps_sync.py: the
rank's own stages, with the weights of the whole model of the same seed, an AdamW and a
`PipelineRunner`; one flushed step per unit, step k feeding the batch
`TokenWindows.batch(k, m*b, seed)`) or, with `--async`, `AsyncSteps` (asynchronous/steps.py:
one Program per unit, several steps without a flush). After each unit come the observers
(observers.py): the progress line of each step and `--metrics` (printed by the rank holding
the last stage), the held-out evaluation when due, the ranks' agreement on a stop, the
checkpoint when due; the strategy then builds the rank's result.

Checkpoints go to `cfg.checkpoint.directory` every `save_every` steps and after the last one
(see checkpoint.py); `resume` continues from the newest step intact on every rank (each
rank verifies its own files, then the ranks agree). With data parallelism or sharding
they go through torch.distributed.checkpoint instead (sharded_checkpoint.py), loadable at
another dp size; an asynchronous run saves drained steps (asynchronous/checkpoint.py).
`launch` refuses a directory holding another run's checkpoints unless `overwrite`.

A run that stops early saves too: on a stop request (SIGTERM, SIGINT or SIGHUP, see
pipeblocks.runtime.lifecycle) every rank stops after the same step and saves it; a rank
of a synchronous run that fails or is interrupted saves its last completed step on the way
out (its weights, optimizer and RNG as they were after that step), when it still can.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from ..runtime import RankFailedError, RunStoppedError
from ..runtime.launch import run_here, spawn, under_torchrun
from ..runtime.mesh import check_world_size
from . import checkpoint as ckpt
from . import sharded_checkpoint as sharded
from .asynchronous.drain import shared_boundary
from .asynchronous.steps import AsyncRankResult, AsyncSteps
from .config import TrainConfig
from .observers import Progress, claim_checkpoints, evaluate_if_due, save_when_due
from .report import RankResult
from .sharded_checkpoint import uses_sharded_checkpoints
from .steps_sync import SyncSteps

__all__ = ["Ran", "TrainConfig", "checkpoint_note", "launch", "launch_reported", "run_loop",
           "train_rank", "uses_sharded_checkpoints"]


def launch(cfg: TrainConfig) -> list[RankResult] | list[AsyncRankResult] | None:
    """Run `cfg` in p x dp x tp processes: local ones (gloo on CPU, NCCL on CUDA), or, under
    torchrun, this process as its rank. A failure on any rank raises here. Returns every
    rank's result, on the launching process (rank 0 under torchrun; None on the others). An
    asynchronous run spawns its p ranks here and shares the drain boundary with them."""
    torchrun = under_torchrun()
    if not torchrun or reporting_process():
        claim_checkpoints(cfg)
    world = cfg.world_size
    check_world_size(cfg.schedule.p, cfg.dp, world, cfg.tp)
    if cfg.async_mode is not None:
        return spawn(train_rank, world, args=(cfg, shared_boundary()), timeout_s=cfg.timeout_s,
                     threads_per_rank=cfg.threads_for(world), device=cfg.mesh.device)
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
    return not under_torchrun() or os.environ.get("RANK") == "0"


def train_rank(ctx, cfg: TrainConfig, shared=None) -> RankResult | AsyncRankResult:
    """The body of one rank (`ctx` is the runtime's DistContext): the loop over the step
    strategy of `cfg`, asynchronous (`shared`: the drain boundary its launcher shares) or
    synchronous; `--verify` of a synchronous run takes its one step without the observers."""
    last_good = _LastGood()
    try:
        if cfg.async_mode is not None:
            return run_loop(ctx, cfg, AsyncSteps(ctx, cfg, shared))
        steps = SyncSteps(ctx, cfg, last_good)
        return steps.verify() if cfg.verify else run_loop(ctx, cfg, steps)
    except BaseException:
        last_good.save_on_the_way_out(cfg, ctx.control)
        raise


@dataclass(frozen=True)
class Ran:
    """What the loop did, for the step strategy's result: the steps complete when it ended,
    the steps it saved, and the held-out losses (0-based step, loss) it evaluated."""

    done: int
    saved: tuple[int, ...]
    eval_losses: tuple[tuple[int, float], ...]


def run_loop(ctx, cfg: TrainConfig, steps):
    """The one training loop: each unit of work of the step strategy (`steps.units()`: one
    step, or one asynchronous Program), then the observers in that order: the held-out
    evaluation when due, the agreement on a stop, the checkpoint when due. The strategy
    reports each step to `Progress` as it completes."""
    control, setup = ctx.control, steps.setup
    progress = Progress(cfg, setup)
    saved, evals, done = [], [], steps.start
    for unit in steps.units():
        done = steps.run(unit, progress)
        held = evaluate_if_due(cfg, ctx, setup, done, cfg.steps)
        progress.evaluated(done, held)
        if held is not None:
            evals.append((done - 1, held))
        stop = steps.agree_stop(done)  # True on every rank after the same step
        if save_when_due(cfg, control, done, steps.save, final=stop or done == cfg.steps):
            saved.append(done)
        if stop:
            break
    progress.close()
    sys.stdout.flush()
    return steps.result(Ran(done, tuple(saved), tuple(evals)))


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


def launch_reported(cfg: TrainConfig) -> list[RankResult] | list[AsyncRankResult] | None:
    """`launch(cfg)`. A rank that failed or a run that made no progress is reported on stderr,
    followed by what its checkpoint directory now resumes from (`checkpoint_note`), and gives
    None; a run stopped by a signal exits with 128 + the signal, the shell's convention for a
    signalled process."""
    try:
        return launch(cfg)
    except (RankFailedError, TimeoutError, RunStoppedError) as err:
        print(f"pipeblocks train: {err}\npipeblocks train: {checkpoint_note(cfg)}", file=sys.stderr)
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


