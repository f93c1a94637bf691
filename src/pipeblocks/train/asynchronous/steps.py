"""The asynchronous step strategy of the training loop (train/loop.py): one Program per call.

    >>> steps = AsyncSteps(ctx, cfg, shared)   # this rank's stages, resumed if asked; shared: the drain boundary
    >>> done = steps.run(segment, progress)    # one Program of the run; the steps complete after it

In order: the rank's stages (`rank_setup.setup_rank`), one `AsyncStage` per stage with its
own AdamW; the checkpoint it resumes, if any (asynchronous/checkpoint.py); the run's
Programs from there (`units`, plan.py: warm-up steps, then asynchronous segments ending at
the save and evaluation points). `run` runs one Program, one `PipelineRunner.step`; the
rank holding the last stage reports each optimizer step to the loop's progress observer
as it happens. A stop request drains the running Program early (drain.py); the ranks
agree on it after each Program (`agree_stop`, one all-reduce), and the loop saves the
drained step and ends.

Every rank returns its losses, delays, rates, step times and the timed passes of every
Program (`SegmentRecord`) for the report (`result`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...core.ir.actions import Action
from ...core.ir.ops import OptimizerStep
from ...runtime import PipelineRunner
from .. import checkpoint as ckpt
from ..config import TrainConfig
from ..rank_setup import emulated_costs, setup_rank
from .checkpoint import resume_async, save_async
from .compute import AsyncCompute, EmulatedAsyncCompute
from .drain import Drain
from .plan import Segment, nominal_delays, run_segments, run_versions, segment_program
from .stage import AsyncStage

__all__ = ["AsyncRankResult", "AsyncSteps", "SegmentRecord", "microbatches"]


@dataclass(frozen=True)
class SegmentRecord:
    """One Program a rank ran: its first step, the steps it completed (fewer than planned
    when drained), and this rank's timed passes and steps (the Program's own numbering)."""

    segment: Segment
    steps_run: int
    events: tuple[tuple[Action | OptimizerStep, float, float], ...] = ()


@dataclass(frozen=True)
class AsyncRankResult:
    """What one rank of an asynchronous run reports."""

    rank: int
    stages: tuple[int, ...]
    losses: tuple[float, ...]
    """per optimizer step from `first_step`, the mean loss of its microbatches (the last stage's rank; else empty)"""
    delays: dict[int, tuple[int, ...]]
    """per stage of this rank, the delay of every microbatch run, measured (from `first_step`'s first)"""
    lrs: dict[int, tuple[float, ...]]
    """per stage of this rank, its learning rate at every step run"""
    warmup_s: float
    """wall time of the synchronous warm-up steps"""
    async_s: float
    """wall time of the asynchronous Programs (fill and drain included)"""
    step_times: tuple[float, ...] = ()
    """when each optimizer step of the rank's first stage was done (seconds, perf_counter)"""
    params: dict[tuple[int, str], object] | None = None
    """(stage, name) -> the weights after the run (verify only)"""
    versions_held: dict[int, int] | None = None
    """per stage of this rank, the most weight versions it held at once (stashes included)"""
    first_step: int = 0
    """the step the run started from (a resumed run's checkpoint)"""
    done: int = 0
    """the steps complete when the rank stopped"""
    drained_at: int | None = None
    """the step a stop request drained the run at (None: it ran to its end)"""
    saved: tuple[int, ...] = ()
    """the steps this rank checkpointed"""
    segments: tuple[SegmentRecord, ...] = field(default=(), repr=False)
    eval_losses: tuple[tuple[int, float], ...] = ()
    """(step, held-out loss) after the steps --eval-every evaluated (0-based, as the
    synchronous RankResult's); the last stage's rank only"""


def microbatches(cfg: TrainConfig, data, steps: range) -> tuple[list, list]:
    """The inputs and targets of every microbatch of `steps`, in order."""
    n = cfg.schedule.m
    xs, ys = [], []
    for k in steps:
        x, y = data.batch(k, cfg.batch_size, seed=cfg.seed)
        xs.extend(part.clone() for part in x.chunk(n))
        ys.extend(part.clone() for part in y.chunk(n))
    return xs, ys


class AsyncSteps:
    """The asynchronous step strategy: this rank's `AsyncStage`s, the run's Programs from the
    step it starts at (`units`), and one `run` per Program (see the module doc)."""

    def __init__(self, ctx, cfg: TrainConfig, shared=None) -> None:
        self.ctx, self.cfg = ctx, cfg
        schedule, ck = cfg.schedule.schedule, cfg.checkpoint
        self.setup = setup = setup_rank(ctx, cfg)
        self.mine, self.last = tuple(sorted(setup.modules)), schedule.num_stages - 1
        nominal = nominal_delays(schedule)
        factor = cfg.lr_schedule.factor if cfg.lr_schedule is not None else None
        self.stages = {s: AsyncStage(module, torch.optim.AdamW(module.parameters(), lr=cfg.lr), cfg.async_mode,
                                     nominal[s], lr_factor=factor) for s, module in setup.modules.items()}
        self.start = 0
        if ck is not None:
            ckpt.remove_temporaries(ck.directory, ranks=[ctx.rank])
            if ck.resume:
                self.start = resume_async(cfg, ctx, self.stages, setup.data.source)
        self.segments = run_segments(cfg, start=self.start)
        self.drain = Drain(shared, step_size=schedule.m, stop_requested=lambda: ctx.control.stop_reason is not None)
        self.compute = _compute(cfg, ctx, setup, self.stages, run_versions(schedule, self.segments), self.drain,
                                self._on_step)
        self.xs, self.ys = microbatches(cfg, setup.data, range(self.start, cfg.steps))
        self.runners: dict[tuple[int, bool], tuple] = {}
        self.records: list[SegmentRecord] = []
        self.step_times: list[float] = []
        self.warmup_s = self.async_s = 0.0
        self.drained_at: int | None = None
        self.progress = None
        torch.distributed.barrier()  # the ranks start the clock together, after building their stages
        self.last_time = time.perf_counter()

    def units(self) -> tuple[Segment, ...]:
        return self.segments

    def run(self, segment: Segment, progress) -> int:
        """Run the Program of `segment` (drained early on a stop request); the steps complete after it."""
        self.progress, n, start = progress, self.cfg.schedule.m, self.start
        program, runner = self._runner_for(segment)
        self.compute.start(program, segment.first * n, segment.first)
        a, b = (segment.first - start) * n, (segment.end - start) * n
        began = time.perf_counter()
        runner.step(self.xs[a:b] if 0 in self.mine else None, self.ys[a:b] if self.last in self.mine else None)
        elapsed = time.perf_counter() - began
        if segment.synchronous:
            self.warmup_s += elapsed
        else:
            self.async_s += elapsed
        boundary = self.drain.boundary
        done = boundary // n if boundary is not None else segment.end
        self.records.append(SegmentRecord(segment, done - segment.first, tuple(self.compute.events)))
        if boundary is not None:
            self.drained_at = done
            progress.note(f"drained at step {done} ({self.ctx.control.stop_reason}): the microbatches in flight "
                          "finished, none entered after")
        return done

    def _on_step(self, stage: int, step: int) -> None:
        """The compute's report of an optimizer step: the clock of the first stage, the progress of the last."""
        self.ctx.control.beat()
        if stage == self.mine[0]:
            self.step_times.append(time.perf_counter())
        if stage == self.last and self.progress is not None:
            now = time.perf_counter()
            seconds, self.last_time = now - self.last_time, now
            lrs, cfg = self.compute.lrs.get(self.last), self.cfg
            self.progress.step(step, self.compute.step_loss.get(step), seconds,
                               "  (synchronous)" if step < cfg.async_mode.sync_warmup_steps else "",
                               lr=lrs[-1] if lrs else cfg.lr_at(step))

    def agree_stop(self, done: int) -> bool:
        """Whether any rank has seen a stop request, agreed by all (one small all-reduce after each
        Program): every rank then saves the same step and ends, or none does."""
        flag = torch.tensor([int(self.ctx.control.stop_reason is not None)], dtype=torch.int64,
                            device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def save(self, step: int) -> None:
        save_async(self.cfg, rank=self.ctx.rank, step=step, stages=self.stages, meta=self.cfg.meta(self.setup.data.source))

    def _runner_for(self, segment: Segment):
        """The (Program, PipelineRunner) of a segment's shape, built once per shape."""
        key = (segment.steps, segment.synchronous)
        if key not in self.runners:
            program = segment_program(self.cfg.schedule.schedule, segment)
            self.runners[key] = (program, PipelineRunner(
                program.schedule, self.setup.modules, self.setup.loss_fn, rank=self.ctx.rank, device=self.ctx.device,
                timeout_s=self.cfg.timeout_s, compute=self.compute, measure_memory=False, program=program))
        return self.runners[key]

    def result(self, ran) -> AsyncRankResult:
        """This rank's AsyncRankResult (losses, delays and rates only with real compute); `ran`: the loop's record."""
        cfg, stages, compute = self.cfg, self.stages, self.compute
        common = {"first_step": self.start, "done": ran.done, "drained_at": self.drained_at, "saved": ran.saved,
                  "segments": tuple(self.records), "eval_losses": ran.eval_losses}
        timing = (self.warmup_s, self.async_s, tuple(self.step_times))
        if cfg.emulation is not None:
            return AsyncRankResult(self.ctx.rank, self.mine, (), {}, {}, *timing, **common)
        n = cfg.schedule.m
        run = range(self.start * n, ran.done * n)
        losses = tuple(compute.step_loss[k] for k in range(self.start, ran.done)) if self.last in self.mine else ()
        delays = {s: tuple(st.delays[mb] for mb in run) for s, st in stages.items()}
        params = None
        if cfg.verify:
            params = {(s, name): p.detach().cpu().clone() for s, mod in self.setup.modules.items()
                      for name, p in mod.named_parameters()}
        return AsyncRankResult(self.ctx.rank, self.mine, losses, delays, {s: tuple(v) for s, v in compute.lrs.items()},
                               *timing, params, {s: st.most_versions for s, st in stages.items()}, **common)


def _compute(cfg: TrainConfig, ctx, setup, stages, versions, drain, on_step):
    """The compute the runners call: the stages' versioned passes, or their emulated costs."""
    schedule = cfg.schedule.schedule
    if cfg.emulation is not None:
        return EmulatedAsyncCompute(emulated_costs(cfg), setup.modules, schedule.num_stages, ctx.device,
                                    rank=ctx.rank, on_step=on_step, drain=drain, step_size=schedule.m)
    return AsyncCompute(stages, versions, setup.loss_fn, last_stage=schedule.num_stages - 1, rank=ctx.rank,
                        on_step=on_step, drain=drain)
