"""The body of one rank of an asynchronous run (`launch_async` spawns p of them).

    result = async_rank(ctx, cfg, shared)    # ctx: the runtime's DistContext; shared: the drain boundary

In order: the rank's stages (`rank_setup.setup_rank`), one `AsyncStage` per stage with its
own AdamW; the checkpoint it resumes, if any (asynchronous/checkpoint.py); the run's
Programs from there (plan.py: warm-up steps, then asynchronous segments ending at the save
points); then each Program in turn, one `PipelineRunner.step` each. After a Program the
rank saves when the step is a save point, the last step, or a stop: a stop request drains
the running Program early (drain.py), the ranks agree on it (one all-reduce after each
Program), save the drained step, and the run ends.

The rank holding the last stage prints one progress line per optimizer step of that stage
(and writes `--metrics`); every rank returns its losses, delays, rates, step times and
the timed passes of every Program (`SegmentRecord`) for the report.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from ...core.ir.actions import Action
from ...core.ir.program import OptimizerStep
from ..config import TrainConfig
from .plan import Segment, nominal_delays, plan_segments, run_versions, segment_program

__all__ = ["AsyncRankResult", "SegmentRecord", "async_rank", "microbatches"]


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


def microbatches(cfg: TrainConfig, data, steps: range) -> tuple[list, list]:
    """The inputs and targets of every microbatch of `steps`, in order."""
    n = cfg.schedule.m
    xs, ys = [], []
    for k in steps:
        x, y = data.batch(k, cfg.batch_size, seed=cfg.seed)
        xs.extend(part.clone() for part in x.chunk(n))
        ys.extend(part.clone() for part in y.chunk(n))
    return xs, ys


def async_rank(ctx, cfg: TrainConfig, shared=None) -> AsyncRankResult:
    """Build this rank's stages, resume if asked, run the run's Programs (see the module doc)."""
    import torch

    from ...runtime import PipelineRunner
    from ..rank_setup import setup_rank
    from .checkpoint import resume_async, save_async
    from .compute import AsyncCompute, EmulatedAsyncCompute
    from .drain import Drain
    from .stage import AsyncStage

    schedule, mode, ck = cfg.schedule.schedule, cfg.async_mode, cfg.checkpoint
    n, w, last = schedule.m, mode.sync_warmup_steps, schedule.num_stages - 1
    setup = setup_rank(ctx, cfg)
    mine, modules, data, loss_fn = tuple(sorted(setup.modules)), setup.modules, setup.data, setup.loss_fn
    nominal = nominal_delays(schedule)
    factor = cfg.lr_schedule.factor if cfg.lr_schedule is not None else None
    stages = {s: AsyncStage(module, torch.optim.AdamW(module.parameters(), lr=cfg.lr), mode, nominal[s],
                            lr_factor=factor) for s, module in modules.items()}
    start = 0
    if ck is not None:
        from .. import checkpoint as ckpt

        ckpt.remove_temporaries(ck.directory, ranks=[ctx.rank])
        if ck.resume:
            start = resume_async(cfg, ctx, stages, data.source)
    segments = plan_segments(steps=cfg.steps, warmup=w, start=start, save_every=ck.save_every if ck else 0)
    versions = run_versions(schedule, segments)
    drain = Drain(shared, step_size=n, stop_requested=lambda: ctx.control.stop_reason is not None)
    progress = _Progress(cfg, ctx.rank, last in mine, start)
    step_times: list[float] = []

    def on_step(stage: int, step: int) -> None:
        ctx.control.beat()
        if stage == mine[0]:
            step_times.append(time.perf_counter())
        if stage == last:
            progress.step(step, compute.step_loss.get(step), compute.lrs[last][-1] if compute.lrs.get(last) else None)

    if cfg.emulation is not None:
        from ..rank_setup import emulated_costs

        compute = EmulatedAsyncCompute(emulated_costs(cfg), modules, schedule.num_stages, ctx.device, on_step=on_step,
                                       drain=drain, step_size=n)
        compute.lrs = {}
    else:
        compute = AsyncCompute(stages, versions, loss_fn, last_stage=last, rank=ctx.rank, on_step=on_step,
                               drain=drain)
    first, has_last = 0 in mine, last in mine
    xs, ys = microbatches(cfg, data, range(start, cfg.steps))
    runners: dict[tuple[int, bool], tuple] = {}

    def runner_for(segment: Segment):
        key = (segment.steps, segment.synchronous)
        if key not in runners:
            program = segment_program(schedule, segment)
            runners[key] = (program, PipelineRunner(program.schedule, modules, loss_fn, rank=ctx.rank, device=ctx.device,
                                                    timeout_s=cfg.timeout_s, compute=compute, measure_memory=False,
                                                    program=program))
        return runners[key]

    records, saved, done, drained_at = [], [], start, None
    warm_s = async_s = 0.0
    torch.distributed.barrier()  # the ranks start the clock together, after building their stages
    progress.last_time = time.perf_counter()
    for segment in segments:
        program, runner = runner_for(segment)
        a, b = (segment.first - start) * n, (segment.end - start) * n
        if cfg.emulation is not None:
            compute.start(program, segment.first * n, segment.first, rank=ctx.rank)
        else:
            compute.start(program, segment.first * n, segment.first)
        began = time.perf_counter()
        runner.step(xs[a:b] if first else None, ys[a:b] if has_last else None)
        elapsed = time.perf_counter() - began
        if segment.synchronous:
            warm_s += elapsed
        else:
            async_s += elapsed
        boundary = drain.boundary
        done = boundary // n if boundary is not None else segment.end
        records.append(SegmentRecord(segment, done - segment.first, tuple(compute.events)))
        stop = _agree_stop(ctx)
        if boundary is not None:
            drained_at = done
            progress.note(f"drained at step {done} ({ctx.control.stop_reason}): the microbatches in flight finished, "
                          "none entered after")
        if ck is not None and (stop or done == cfg.steps or (ck.save_every and done % ck.save_every == 0)):
            with ctx.control.critical():
                save_async(cfg, rank=ctx.rank, step=done, stages=stages, meta=cfg.meta(data.source))
            ctx.control.beat()
            saved.append(done)
        if stop:
            break
    progress.close()
    sys.stdout.flush()
    run = range(start * n, done * n)
    if cfg.emulation is not None:
        return AsyncRankResult(ctx.rank, mine, (), {}, {}, warm_s, async_s, tuple(step_times), first_step=start,
                               done=done, drained_at=drained_at, saved=tuple(saved), segments=tuple(records))
    losses = tuple(compute.step_loss[k] for k in range(start, done)) if has_last else ()
    delays = {s: tuple(st.delays[mb] for mb in run) for s, st in stages.items()}
    params = None
    if cfg.verify:
        params = {(s, name): p.detach().cpu().clone() for s, mod in modules.items() for name, p in mod.named_parameters()}
    return AsyncRankResult(ctx.rank, mine, losses, delays, {s: tuple(v) for s, v in compute.lrs.items()}, warm_s,
                           async_s, tuple(step_times), params, {s: st.most_versions for s, st in stages.items()},
                           first_step=start, done=done, drained_at=drained_at, saved=tuple(saved),
                           segments=tuple(records))


def _agree_stop(ctx) -> bool:
    """Whether any rank has seen a stop request, agreed by all (one small all-reduce after each
    Program): every rank then saves the same step and ends, or none does."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(ctx.control.stop_reason is not None)], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class _Progress:
    """The last stage's rank: one line per optimizer step, and `--metrics`."""

    def __init__(self, cfg: TrainConfig, rank: int, holds_last: bool, start: int) -> None:
        self.cfg, self.rank, self.on = cfg, rank, holds_last
        self.last_time = time.perf_counter()
        self.metrics = None
        if holds_last and cfg.metrics is not None and not cfg.verify:
            from ..metrics import MetricsWriter

            self.metrics = MetricsWriter(cfg.metrics, resume=cfg.checkpoint is not None and cfg.checkpoint.resume)

    def step(self, step: int, loss: float | None, lr: float | None) -> None:
        if not self.on:
            return
        now = time.perf_counter()
        seconds, self.last_time = now - self.last_time, now
        cfg = self.cfg
        if self.metrics is not None:
            self.metrics.write(step=step + 1, loss=loss, lr=lr if lr is not None else cfg.lr_at(step),
                               step_time_s=seconds, tokens=cfg.tokens_per_step, rank=self.rank)
        if cfg.quiet or cfg.verify:
            return
        shown = "emulated" if loss is None else f"{loss:.4f}"
        sync = "  (synchronous)" if step < cfg.async_mode.sync_warmup_steps else ""
        print(f"step {step + 1:>5}/{cfg.steps}  loss {shown}  {cfg.tokens_per_step / seconds:>9,.0f} tokens/s  "
              f"{seconds * 1e3:7.1f} ms{sync}", flush=True)

    def note(self, text: str) -> None:
        if self.on:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
