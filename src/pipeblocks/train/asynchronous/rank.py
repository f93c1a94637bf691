"""The body of one rank of an asynchronous run (`launch_async` spawns p of them).

    result = async_rank(ctx, cfg, shared)    # ctx: the runtime's DistContext; shared: the drain boundary

In order: the rank's stages (`rank_setup.setup_rank`), one `AsyncStage` per stage with its
own AdamW; the checkpoint it resumes, if any (asynchronous/checkpoint.py); the run's
Programs from there (plan.py: warm-up steps, then asynchronous segments ending at the save
points); then each Program in turn, one `PipelineRunner.step` each. After a Program the
rank saves when the step is a save point, the last step, or a stop: a stop request drains
the running Program early (drain.py), the ranks agree on it (one all-reduce after each
Program), save the drained step, and the run ends. With `--eval-every` the Programs also
end at the evaluation points, where every rank takes part in the held-out loss
(train/observers.py, as the synchronous loop does).

The rank holding the last stage prints one progress line per optimizer step of that stage
(and writes `--metrics`); every rank returns its losses, delays, rates, step times and
the timed passes of every Program (`SegmentRecord`) for the report.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...core.ir.actions import Action
from ...core.ir.ops import OptimizerStep
from ...runtime import PipelineRunner
from .. import checkpoint as ckpt
from ..config import TrainConfig
from ..observers import evaluate_if_due, evaluation_due, metrics_writer, progress_line, save_when_due
from ..rank_setup import emulated_costs, setup_rank
from .checkpoint import resume_async, save_async
from .compute import AsyncCompute, EmulatedAsyncCompute
from .drain import Drain
from .plan import Segment, nominal_delays, run_segments, run_versions, segment_program
from .stage import AsyncStage

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


def async_rank(ctx, cfg: TrainConfig, shared=None) -> AsyncRankResult:
    """Build this rank's stages, resume if asked, run the run's Programs (see the module doc)."""
    schedule, mode, ck = cfg.schedule.schedule, cfg.async_mode, cfg.checkpoint
    n, last = schedule.m, schedule.num_stages - 1
    setup = setup_rank(ctx, cfg)
    mine, modules, data = tuple(sorted(setup.modules)), setup.modules, setup.data
    nominal = nominal_delays(schedule)
    factor = cfg.lr_schedule.factor if cfg.lr_schedule is not None else None
    stages = {s: AsyncStage(module, torch.optim.AdamW(module.parameters(), lr=cfg.lr), mode, nominal[s],
                            lr_factor=factor) for s, module in modules.items()}
    start = 0
    if ck is not None:
        ckpt.remove_temporaries(ck.directory, ranks=[ctx.rank])
        if ck.resume:
            start = resume_async(cfg, ctx, stages, data.source)
    segments = run_segments(cfg, start=start)

    def save(step: int) -> None:
        save_async(cfg, rank=ctx.rank, step=step, stages=stages, meta=cfg.meta(data.source))

    drain = Drain(shared, step_size=n, stop_requested=lambda: ctx.control.stop_reason is not None)
    progress = _Progress(cfg, ctx.rank, metrics_writer(cfg, setup), last in mine)
    step_times: list[float] = []

    def on_step(stage: int, step: int) -> None:
        ctx.control.beat()
        if stage == mine[0]:
            step_times.append(time.perf_counter())
        if stage == last:
            progress.step(step, compute.step_loss.get(step), compute.lrs[last][-1] if compute.lrs.get(last) else None)

    compute = _compute(cfg, ctx, setup, stages, run_versions(schedule, segments), drain, on_step)
    first, has_last = 0 in mine, last in mine
    xs, ys = microbatches(cfg, data, range(start, cfg.steps))
    runners: dict[tuple[int, bool], tuple] = {}
    records, saved, evals, done, drained_at = [], [], [], start, None
    warm_s = async_s = 0.0
    torch.distributed.barrier()  # the ranks start the clock together, after building their stages
    progress.last_time = time.perf_counter()
    for segment in segments:
        program, runner = _runner_for(segment, runners, cfg, ctx, setup, compute)
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
        held = evaluate_if_due(cfg, ctx, setup, done, cfg.steps)
        progress.evaluated(done, held)
        if held is not None:
            evals.append((done - 1, held))
        stop = _agree_stop(ctx)
        if boundary is not None:
            drained_at = done
            progress.note(f"drained at step {done} ({ctx.control.stop_reason}): the microbatches in flight finished, "
                          "none entered after")
        if save_when_due(cfg, ctx.control, done, save, final=stop or done == cfg.steps):
            saved.append(done)
        if stop:
            break
    progress.close()
    sys.stdout.flush()
    ran = _Ran(start, done, drained_at, tuple(saved), tuple(records), warm_s, async_s, tuple(step_times),
               tuple(evals))
    return _result(cfg, ctx, mine, stages, compute, ran, modules)


@dataclass(frozen=True)
class _Ran:
    """What the loop of one rank measured and did, for its result."""

    start: int
    done: int
    drained_at: int | None
    saved: tuple[int, ...]
    records: tuple[SegmentRecord, ...]
    warmup_s: float
    async_s: float
    step_times: tuple[float, ...]
    eval_losses: tuple[tuple[int, float], ...]


def _compute(cfg: TrainConfig, ctx, setup, stages, versions, drain, on_step):
    """The compute the runners call: the stages' versioned passes, or their emulated costs."""
    schedule = cfg.schedule.schedule
    if cfg.emulation is not None:
        compute = EmulatedAsyncCompute(emulated_costs(cfg), setup.modules, schedule.num_stages, ctx.device,
                                       on_step=on_step, drain=drain, step_size=schedule.m)
        compute.lrs = {}
        return compute
    return AsyncCompute(stages, versions, setup.loss_fn, last_stage=schedule.num_stages - 1, rank=ctx.rank,
                        on_step=on_step, drain=drain)


def _runner_for(segment: Segment, runners: dict, cfg: TrainConfig, ctx, setup, compute):
    """The (Program, PipelineRunner) of a segment's shape, built once per shape."""
    key = (segment.steps, segment.synchronous)
    if key not in runners:
        program = segment_program(cfg.schedule.schedule, segment)
        runners[key] = (program, PipelineRunner(program.schedule, setup.modules, setup.loss_fn, rank=ctx.rank,
                                                device=ctx.device, timeout_s=cfg.timeout_s, compute=compute,
                                                measure_memory=False, program=program))
    return runners[key]


def _result(cfg: TrainConfig, ctx, mine, stages, compute, ran: _Ran, modules) -> AsyncRankResult:
    """This rank's AsyncRankResult (losses, delays and rates only with real compute)."""
    common = {"first_step": ran.start, "done": ran.done, "drained_at": ran.drained_at, "saved": ran.saved,
              "segments": ran.records, "eval_losses": ran.eval_losses}
    if cfg.emulation is not None:
        return AsyncRankResult(ctx.rank, mine, (), {}, {}, ran.warmup_s, ran.async_s, ran.step_times, **common)
    n, last = cfg.schedule.m, cfg.schedule.schedule.num_stages - 1
    run = range(ran.start * n, ran.done * n)
    losses = tuple(compute.step_loss[k] for k in range(ran.start, ran.done)) if last in mine else ()
    delays = {s: tuple(st.delays[mb] for mb in run) for s, st in stages.items()}
    params = None
    if cfg.verify:
        params = {(s, name): p.detach().cpu().clone() for s, mod in modules.items() for name, p in mod.named_parameters()}
    return AsyncRankResult(ctx.rank, mine, losses, delays, {s: tuple(v) for s, v in compute.lrs.items()},
                           ran.warmup_s, ran.async_s, ran.step_times, params,
                           {s: st.most_versions for s, st in stages.items()}, **common)


def _agree_stop(ctx) -> bool:
    """Whether any rank has seen a stop request, agreed by all (one small all-reduce after each
    Program): every rank then saves the same step and ends, or none does."""
    flag = torch.tensor([int(ctx.control.stop_reason is not None)], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class _Progress:
    """The last stage's rank: one line per optimizer step, and `--metrics` (a step the held-out
    loss is evaluated after waits for it, so its line carries `eval_loss` as in a synchronous run)."""

    def __init__(self, cfg: TrainConfig, rank: int, metrics, holds_last: bool) -> None:
        self.cfg, self.rank, self.on, self.metrics = cfg, rank, holds_last, metrics
        self.last_time = time.perf_counter()
        self.pending: dict | None = None

    def step(self, step: int, loss: float | None, lr: float | None) -> None:
        if not self.on:
            return
        now = time.perf_counter()
        seconds, self.last_time = now - self.last_time, now
        cfg = self.cfg
        if self.metrics is not None:
            self._flush()
            self.pending = {"step": step + 1, "loss": loss, "lr": lr if lr is not None else cfg.lr_at(step),
                            "step_time_s": seconds, "tokens": cfg.tokens_per_step, "rank": self.rank}
            if not evaluation_due(cfg, step + 1, cfg.steps):
                self._flush()
        if cfg.quiet or cfg.verify:
            return
        progress_line(cfg, step, "emulated" if loss is None else f"{loss:.4f}", seconds,
                      "  (synchronous)" if step < cfg.async_mode.sync_warmup_steps else "")

    def evaluated(self, done: int, loss: float | None) -> None:
        """The held-out loss after step `done` (None: none was evaluated) joins that step's metrics line."""
        if self.pending is not None and self.pending["step"] == done:
            self._flush(eval_loss=loss)

    def _flush(self, eval_loss: float | None = None) -> None:
        if self.pending is not None:
            self.metrics.write(**self.pending, eval_loss=eval_loss)
            self.pending = None

    def note(self, text: str) -> None:
        if self.on:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.metrics is not None:
            self._flush()
            self.metrics.close()
