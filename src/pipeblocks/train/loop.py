"""The training loop behind `pipeblocks train`: one process per pipeline rank.

    >>> cfg, data = prepare(ScheduleRequest(name="1f1b", m=4, mesh=Mesh(pp=2)), model=GPTConfig(layers=4), steps=20)
    >>> results = launch(cfg)       # p local processes (or this one, under torchrun); one RankResult per rank

The loop is `_train_rank`: one `_SyncSteps.run` per step (the synchronous step strategy;
the asynchronous one is asynchronous/rank.py), then the observers both loops share
(observers.py: progress line, evaluation, metrics, checkpoint when due).

Each rank builds what `rank_setup.setup_rank` builds (only its own stages, with the weights
of the whole model of the same seed; the precision; the data-parallel wrapper), an AdamW
over their parameters, and a `PipelineRunner`. Step k feeds the batch `TokenWindows.batch(k, m*b, seed)` (the runner
cuts it into m microbatches), then steps the optimizer. The rank that holds the last
stage prints one progress line per step. The optimizer steps through a `PostValidator`
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
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..data import TokenWindows
from . import checkpoint as ckpt
from . import sharded_checkpoint as sharded
from .config import TrainConfig
from .observers import claim_checkpoints, evaluate_if_due, metrics_writer, progress_line, save_when_due, writes_progress
from ..runtime.tensor_parallel import settle_partial_grads, tp_local_shape
from .export_hf import save_rank_part
from .post_validation import PostValidator
from .rank_setup import setup_rank
from .report import RankResult

__all__ = ["TrainConfig", "checkpoint_note", "launch", "launch_or_report", "train_rank"]

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


@dataclass(frozen=True)
class _StepDone:
    """What one synchronous step left: the runner's result, the step's loss (on the rank that
    reports it), the optimizer's check, the gradients --verify compares, its wall span."""

    result: object
    loss: float | None
    check: object
    grads: dict | None
    t0: float
    t1: float


class _SyncSteps:
    """The synchronous step strategy: this rank's stages, optimizer (through a PostValidator
    without data or tensor parallelism) and runner; `run(step)` takes one whole step."""

    def __init__(self, ctx, cfg: TrainConfig, last_good: _LastGood) -> None:
        self.ctx, self.cfg, self.last_good = ctx, cfg, last_good
        self.setup = setup = setup_rank(ctx, cfg)
        dp = setup.data_parallel
        self.optimizer = optimizer = (dp.optimizer(torch.optim.AdamW, lr=cfg.lr) if dp is not None
                                      else torch.optim.AdamW(setup.params, lr=cfg.lr))
        if dp is not None and setup.vocab is not None:
            _add_vocab_optimizer(optimizer, setup.vocab, lr=cfg.lr)
        self.start = _restore(cfg, ctx, setup, optimizer)
        # with data or tensor parallelism the optimizer steps directly (prepare refuses --clip-grad there)
        self.validator = None if dp is not None or cfg.tp > 1 else PostValidator(
            optimizer, max_norm=cfg.clip_grad, optimistic=cfg.optimistic_step, timeout_s=cfg.timeout_s,
            counted_twice=setup.tied.counted_twice if setup.tied is not None else ())
        self.runner = _runner(cfg, ctx, setup)
        shapes = {s: [tp_local_shape(p) for p in m.parameters() if p.requires_grad] for s, m in setup.modules.items()}
        self.static_predicted = _predict_static(cfg, self.runner.program, setup.rank, setup.replica, shapes)
        self.static = 0
        """the most parameter, gradient and optimizer-state bytes held so far"""

    def run(self, step: int) -> _StepDone:
        """Feed step `step`'s batch through the pipeline and step the optimizer."""
        cfg, setup, optimizer, runner = self.cfg, self.setup, self.optimizer, self.runner
        dp, built = setup.data_parallel, setup.stages
        inputs, targets = _replica_batch(cfg, setup.data, step, setup.replica)
        optimizer.zero_grad(set_to_none=True)
        set_lr(optimizer, cfg.lr_at(step))
        t0 = time.perf_counter()
        every = setup.vocab is not None  # every rank's vocabulary passes take the tokens and the labels
        result = runner.step(inputs if runner.holds_first_stage or every else None,
                             targets if runner.holds_last_stage or every else None)
        if cfg.tp > 1:
            settle_partial_grads(setup.params)
        if setup.tied is not None:  # the two copies of a tied embedding take the sum of their gradients
            setup.tied.sum_gradients()
        if cfg.inject_nonfinite == step + 1 and setup.rank == cfg.schedule.p - 1:
            next(p.grad for p in setup.params if p.grad is not None).view(-1)[0] = float("inf")
        if dp is None:
            # the step's peak: full gradients, the state of the previous step, the compute copies
            self.static = max(self.static, _static_now(built, optimizer) + (setup.copies.step_bytes if setup.copies
                                                                            else 0))
        grads = _full_grads(built) if cfg.verify and cfg.clip_grad is None else None
        if grads is not None and setup.vocab is not None:  # the tables gathered whole, by the model's names
            grads = {**grads, **_vocab_tables(cfg, setup)[0]}
        with self.ctx.control.critical():  # an interrupt must not leave half the parameters stepped
            check = self.validator.step() if self.validator is not None else optimizer.step()
            self.last_good.stepped(step + 1)
        if dp is not None:
            dp.sample_static()  # after the optimizer step: its state is there, gradients not yet freed
            self.static = max(self.static, dp.peak_static)
        else:
            self.static = max(self.static, _static_now(built, optimizer))
        loss = _replica_mean(result.loss, setup.mesh) if result.loss is not None else None
        if cfg.schedule.schedule.chains > 1:  # DualPipe: each direction's last stage holds its share of the mean
            loss = _chains_total(result.loss, cfg, setup)
        return _StepDone(result, loss, check, grads, t0, time.perf_counter())

    def verify_result(self, step: int, done: _StepDone) -> RankResult:
        """--verify: the step is taken; with clipping, the gradients it used (clipped) are compared."""
        cfg, setup, built = self.cfg, self.setup, self.setup.stages
        grads = done.grads if done.grads is not None else {**_full_grads(built), **_vocab_tables(cfg, setup)[0]}
        return RankResult(setup.rank, tuple(setup.modules), ((step, done.loss),) if done.loss is not None else (),
                          grads=grads, params={**_full_params(built), **_vocab_tables(cfg, setup)[1]},
                          checks=() if done.check is None or cfg.clip_grad is None else ((step, done.check),),
                          dp_rank=setup.replica, static_bytes_measured=self.static,
                          static_bytes_predicted=self.static_predicted[0], tp_rank=setup.tp_rank)


def _train_rank(ctx, cfg: TrainConfig, last_good: _LastGood) -> RankResult:
    """The synchronous loop: one `_SyncSteps.run` per step, then the observers (progress line,
    evaluation, metrics, checkpoint) in that order."""
    steps = _SyncSteps(ctx, cfg, last_good)
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


VOCAB_ROWS = -1
"""The key of the vocabulary rows' optimizer among a data-parallel rank's chunk optimizers."""


def _add_vocab_optimizer(optimizer, vocab, *, lr: float) -> None:
    """--vocab-parallel with --dp: the rows (replicated over dp, their gradients averaged by the
    runner) get an AdamW of their own, stepped with the chunks' (no gathers to issue after it)."""
    optimizer.by_stage[VOCAB_ROWS] = torch.optim.AdamW(vocab.parameters, lr=lr)
    after = optimizer.after_step
    optimizer.after_step = None if after is None else (lambda stage: None if stage == VOCAB_ROWS else after(stage))


def set_lr(optimizer, lr: float) -> None:
    """Give every parameter group the step's learning rate (one optimizer, or one per chunk)."""
    for inner in getattr(optimizer, "by_stage", {0: optimizer}).values():
        for group in inner.param_groups:
            group["lr"] = lr


def _device_max_bytes(device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda" else None


def _restore(cfg: TrainConfig, ctx, setup, optimizer) -> int:
    """The step to start from: 0, or the resumed checkpoint's (after clearing this rank's
    temporaries of an interrupted save)."""
    ck = cfg.checkpoint
    if ck is None:
        return 0
    if not uses_sharded_checkpoints(cfg):
        ckpt.remove_temporaries(ck.directory, ranks=[setup.rank])  # no save of this rank is under way yet
    if not ck.resume:
        return 0
    if uses_sharded_checkpoints(cfg):
        step = _resume_sharded(cfg, setup.modules, optimizer)
    else:
        step = _resume(cfg, ctx, setup.modules, optimizer, setup.data.source)
    if setup.tied is not None:  # the checkpoint holds a tied weight once, on the first stage
        setup.tied.copy_first_to_last()
    return step


def _runner(cfg: TrainConfig, ctx, setup):
    """This rank's PipelineRunner over its stages (emulated compute under `cfg.emulation`)."""
    from ..runtime import PipelineRunner

    compute = _emulated_compute(cfg, setup.modules, ctx.device) if cfg.emulation is not None else None
    vocab = {}
    if setup.vocab is not None:
        from .vocab_setup import vocab_costs

        vocab = {"vocab": setup.vocab, "vocab_costs": vocab_costs(cfg)}
    return PipelineRunner(
        cfg.schedule.schedule, setup.runner_stages, setup.loss_fn, rank=setup.rank, device=ctx.device,
        timeout_s=cfg.timeout_s, record_timeline=not cfg.verify and setup.replica == 0 and setup.tp_rank == 0,
        compute=compute,
        seq_lengths=cfg.schedule.seq_lengths, group=setup.pp_group, data_parallel=setup.data_parallel,
        recompute=cfg.schedule.recompute, recompute_at=cfg.schedule.recompute_anchors,
        precision=setup.copies if compute is None else None, **vocab,
    )


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
        sharded.save_sharded(directory, step=done, stages=setup.modules, optimizers=_chunk_optimizers(optimizer),
                             meta=meta)
    else:
        ckpt.save_rank(directory, rank=setup.rank, step=done, stages=setup.modules, optimizer=optimizer, meta=meta)


def _replica_batch(cfg: TrainConfig, data: TokenWindows, step: int, replica: int):
    """This replica's slice of the step's global batch (dp x m microbatches)."""
    inputs, targets = data.batch(step, cfg.global_batch_size, seed=cfg.seed)
    if cfg.dp == 1:
        return inputs, targets
    n = cfg.batch_size
    return inputs[replica * n:(replica + 1) * n], targets[replica * n:(replica + 1) * n]


def _chains_total(loss: float | None, cfg: TrainConfig, setup) -> float | None:
    """DualPipe's step loss: the sum of the two directions' shares (each the sum of its own
    microbatches' losses over m), on the rank that reports progress (None elsewhere); every
    pipeline rank takes part."""
    import torch.distributed as dist

    total = torch.tensor([loss or 0.0, float(loss is not None)], dtype=torch.float64)
    dist.all_reduce(total, group=setup.pp_group)
    if not writes_progress(cfg, setup) or total[1].item() == 0:
        return None
    return float(total[0].item())


def _replica_mean(loss: float, mesh) -> float:
    """The step's loss over all replicas (the mean of their means: equal microbatches)."""
    if mesh is None or mesh.dp == 1:
        return loss
    import torch.distributed as dist

    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total, group=mesh.dp_group)
    return float(total.item()) / mesh.dp


def _full(tensor):
    """A DTensor (an FSDP2 or tensor-parallel shard) gathered whole; a plain tensor as is."""
    from ..runtime.tensor_parallel import full_tensor

    return full_tensor(tensor)


def _full_grads(built) -> dict:
    return {n: None if p.grad is None else _full(p.grad).detach().cpu().clone()
            for s in built for n, p in s.named_parameters()}


def _vocab_tables(cfg: TrainConfig, setup) -> tuple[dict, dict]:
    """--vocab-parallel: the tables' (gradients, weights) now, gathered whole by their names
    (every pipeline rank takes part); ({}, {}) without it."""
    if setup.vocab is None:
        return {}, {}
    from .vocab_setup import full_tables

    return full_tables(cfg.model.spec(), setup.vocab, setup.pp_group)


def _full_params(built) -> dict:
    return {n: _full(p).detach().cpu().clone() for s in built for n, p in s.named_parameters()}


def _static_now(built, optimizer) -> int:
    """Parameter, gradient and optimizer-state bytes this rank holds now (after the step)."""
    from ..runtime.data_parallel import held_bytes

    tensors = [t for s in built for p in s.parameters() for t in (p, p.grad)]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return held_bytes(tensors)


def _predict_static(cfg: TrainConfig, program, rank: int, replica: int, shapes) -> tuple[int, int]:
    """(first step, later steps) predicted peak static bytes of this rank."""
    from ..core.cost.static_memory import predict_static_peak

    return tuple(
        predict_static_peak(program, rank, shapes, cfg.sharding, dp=cfg.dp, dp_rank=replica,
                            precision=cfg.precision, optimizer_state=held)
        for held in (False, True)
    )


def _resume(cfg: TrainConfig, ctx, stages, optimizer, data_source: str) -> int:
    """Verify this rank's checkpoints, agree with the other ranks on a step, restore it."""
    state = ckpt.load_agreed(cfg.checkpoint.directory, rank=ctx.rank, world_size=ctx.world_size,
                             meta=cfg.meta(data_source))
    return ckpt.restore_rank(state, stages, optimizer)


def uses_sharded_checkpoints(cfg: TrainConfig) -> bool:
    """Whether the run's checkpoints go through torch.distributed.checkpoint: always with data
    or tensor parallelism or sharding, and when resuming such a checkpoint (at any dp or tp size)."""
    ck = cfg.checkpoint
    if ck is None:
        return False
    return cfg.data_parallel or cfg.tp > 1 or (ck.resume and sharded.has_sharded(ck.directory))


def _chunk_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers whose state is saved: one per chunk (ZeRO-1: its local partition's)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    found = getattr(optimizer, "by_stage", None)
    if found is None:
        return [optimizer]
    return [o.optim if isinstance(o, ZeroRedundancyOptimizer) else o for o in found.values()]


def _resume_sharded(cfg: TrainConfig, stages, optimizer) -> int:
    """Restore the newest complete DCP checkpoint (prepare checked it and its run description)."""
    directory = cfg.checkpoint.directory
    step = sharded.latest_sharded_step(directory)
    if step is None:
        raise ValueError(f"--resume: no complete checkpoint in {directory!r}: drop --resume to start from step 0")
    return sharded.load_sharded(directory, step=step, stages=stages, optimizers=_chunk_optimizers(optimizer))


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


def _emulated_compute(cfg: TrainConfig, stages, device):
    from ..runtime.emulate import EmulatedCompute
    from .rank_setup import emulated_costs

    return EmulatedCompute(emulated_costs(cfg), stages, cfg.num_stages, device,
                           vocab_parallel=cfg.schedule.vocab_parallel)
