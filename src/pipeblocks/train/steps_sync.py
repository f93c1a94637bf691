"""The synchronous step strategy of the training loop (train/loop.py): one whole flushed step per call.

    >>> steps = SyncSteps(ctx, cfg, last_good)     # this rank's stages, optimizer, runner; resumed if asked
    >>> done = steps.run(step, progress)           # the step's batch through the pipeline, the optimizer step

`SyncSteps` builds what `rank_setup.setup_rank` builds, an AdamW over the rank's parameters
(one per chunk with data parallelism; through a `PostValidator` otherwise, which clips and
skips a non-finite step on every rank), and a `PipelineRunner`. `run(step, progress)` feeds
the batch `TokenWindows.batch(step, m*b, seed)` (this replica's share of it), settles the
tensor-parallel and tied gradients, steps the optimizer uninterruptibly (`last_good`,
loop.py, learns each completed step) and reports the step to `progress`. It keeps what the
report needs: the spans, the saved-activation peaks, and on rank 0 the measured Timeline of
each of the latest steps (one gather per step), from which the launcher profiles pass
times and the bubble (report.py).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..core.cost.static_memory import predict_static_peak
from ..data import TokenWindows
from ..runtime import PipelineRunner
from ..runtime.data_parallel import held_bytes, measure_link
from ..runtime.emulate import EmulatedCompute
from ..runtime.tensor_parallel import full_tensor, settle_partial_grads, tp_local_shape
from . import checkpoint as ckpt
from . import sharded_checkpoint as sharded
from .config import TrainConfig
from .export_hf import save_rank_part
from .observers import writes_progress
from .post_validation import PostValidator
from .prepare import run_program
from .rank_setup import emulated_costs, setup_rank
from .report import RankResult
from .sharded_checkpoint import uses_sharded_checkpoints
from .vocab_setup import full_tables

__all__ = ["StepDone", "SyncSteps", "chunk_optimizers", "set_lr"]

KEEP_TIMELINES = 32
"""Rank 0 returns the measured timelines of at most this many of the latest steps."""
MEMORY_STEPS = 3
"""Saved-activation bytes are counted on this many first steps and on the last (whose
timeline the report draws); the hooks cost 10-30% of a small CPU step."""


@dataclass(frozen=True)
class StepDone:
    """What one synchronous step left: the runner's result, the step's loss (on the rank that
    reports it), the optimizer's check, the gradients --verify compares, its wall span."""

    result: object
    loss: float | None
    check: object
    grads: dict | None
    t0: float
    t1: float


class SyncSteps:
    """The synchronous step strategy: this rank's stages, optimizer (through a PostValidator
    without data or tensor parallelism) and runner; `run(step)` takes one whole step."""

    def __init__(self, ctx, cfg: TrainConfig, last_good) -> None:
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
        self.link = _dp_link(cfg, setup)
        # a DCP save is a collective: a failing rank cannot take part, so none is saved on the way out
        last_good.track(setup.rank, None if uses_sharded_checkpoints(cfg) else setup.modules, optimizer,
                        cfg.meta(setup.data.source), self.start)
        self.losses, self.spans, self.skipped, self.dp_waits = [], [], [], []
        self.peak = 0
        self.timelines: deque = deque(maxlen=KEEP_TIMELINES)
        ctx.control.step_done(self.start)

    def units(self) -> range:
        return range(self.start, self.cfg.steps)

    def run(self, step: int, progress) -> int:
        """Take step `step`, report it to `progress`, keep what the report needs; the steps complete after it."""
        cfg, setup = self.cfg, self.setup
        self.runner.measure_memory = step < self.start + MEMORY_STEPS or step == cfg.steps - 1
        done = self._take(step)
        result, loss, check = done.result, done.loss, done.check
        if check is not None and check.outcome == "skipped":
            self.skipped.append(step)
        if setup.data_parallel is not None:
            self.dp_waits.append(setup.data_parallel.wait_s)
        self.spans.append((step, done.t0, done.t1))
        self.peak = max(self.peak, result.peak_saved_bytes or 0)
        if result.timeline is not None:
            self.timelines.append((step, result.timeline))
        if loss is not None:
            self.losses.append((step, loss))
            progress.step(step, loss, done.t1 - done.t0, "" if check is None else _check_note(check, cfg.clip_grad),
                          lr=cfg.lr_at(step), activation_bytes=result.peak_saved_bytes or None,
                          static_bytes=self.static, device_max_bytes=_device_max_bytes(self.ctx.device))
        return step + 1

    def agree_stop(self, done: int) -> bool:
        return self.ctx.control.step_done(done)  # True on every rank after the same step

    def save(self, done: int) -> None:
        """Save step `done` of this rank (through torch.distributed.checkpoint when sharded)."""
        cfg, setup = self.cfg, self.setup
        directory, meta = cfg.checkpoint.directory, cfg.meta(setup.data.source)
        if uses_sharded_checkpoints(cfg):
            sharded.save_sharded(directory, step=done, stages=setup.modules, optimizers=chunk_optimizers(self.optimizer),
                                 meta=meta)
        else:
            ckpt.save_rank(directory, rank=setup.rank, step=done, stages=setup.modules, optimizer=self.optimizer,
                           meta=meta)
        self.last_good.saved = done

    def result(self, ran) -> RankResult:
        """This rank's RankResult, after writing its part of `--save-hf` when the run reached its last step."""
        cfg, setup, spans = self.cfg, self.setup, self.spans
        if cfg.save_hf is not None and spans and spans[-1][0] + 1 == cfg.steps:
            with self.ctx.control.critical():
                save_rank_part(cfg, setup)  # every rank: the gathers of sharded stages are collectives
            self.ctx.control.beat()
        # the optimizer state exists from the second step on: the steady-state peak
        predicted = self.static_predicted[1] if len(spans) > 1 else self.static_predicted[0]
        return RankResult(setup.rank, tuple(setup.modules), tuple(self.losses), tuple(spans), self.peak,
                          tuple(self.timelines), skipped_steps=tuple(self.skipped), dp_rank=setup.replica,
                          static_bytes_measured=self.static, static_bytes_predicted=predicted,
                          dp_wait_s=tuple(self.dp_waits), dp_link=self.link, eval_losses=ran.eval_losses,
                          tp_rank=setup.tp_rank)

    def verify(self) -> RankResult:
        """--verify: the first step is taken; with clipping, the gradients it used (clipped) are compared."""
        self.runner.measure_memory = True
        step = self.start
        done = self._take(step)
        cfg, setup, built = self.cfg, self.setup, self.setup.stages
        grads = done.grads if done.grads is not None else {**_full_grads(built), **_vocab_tables(cfg, setup)[0]}
        return RankResult(setup.rank, tuple(setup.modules), ((step, done.loss),) if done.loss is not None else (),
                          grads=grads, params={**_full_params(built), **_vocab_tables(cfg, setup)[1]},
                          checks=() if done.check is None or cfg.clip_grad is None else ((step, done.check),),
                          dp_rank=setup.replica, static_bytes_measured=self.static,
                          static_bytes_predicted=self.static_predicted[0], tp_rank=setup.tp_rank)

    def _take(self, step: int) -> StepDone:
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
        return StepDone(result, loss, check, grads, t0, time.perf_counter())


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
    else:  # verify this rank's checkpoints, agree with the other ranks on a step, restore it
        state = ckpt.load_agreed(ck.directory, rank=ctx.rank, world_size=ctx.world_size, meta=cfg.meta(setup.data.source))
        step = ckpt.restore_rank(state, setup.modules, optimizer)
    if setup.tied is not None:  # the checkpoint holds a tied weight once, on the first stage
        setup.tied.copy_first_to_last()
    return step


def _runner(cfg: TrainConfig, ctx, setup):
    """This rank's PipelineRunner over its stages (emulated compute under `cfg.emulation`)."""
    compute = None if cfg.emulation is None else EmulatedCompute(
        emulated_costs(cfg), setup.modules, cfg.num_stages, ctx.device, vocab_parallel=cfg.schedule.vocab_parallel)
    vocab = {"vocab": setup.vocab} if setup.vocab is not None else {}
    return PipelineRunner(
        cfg.schedule.schedule, setup.runner_stages, setup.loss_fn, rank=setup.rank, device=ctx.device,
        timeout_s=cfg.timeout_s, record_timeline=not cfg.verify and setup.replica == 0 and setup.tp_rank == 0,
        compute=compute,
        seq_lengths=cfg.schedule.seq_lengths, group=setup.pp_group, data_parallel=setup.data_parallel,
        recompute=cfg.schedule.recompute, program=run_program(cfg),  # the Program the dry run resolved
        precision=setup.copies if compute is None else None, **vocab,
    )


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
    total = torch.tensor([loss or 0.0, float(loss is not None)], dtype=torch.float64)
    dist.all_reduce(total, group=setup.pp_group)
    if not writes_progress(cfg, setup) or total[1].item() == 0:
        return None
    return float(total[0].item())


def _replica_mean(loss: float, mesh) -> float:
    """The step's loss over all replicas (the mean of their means: equal microbatches)."""
    if mesh is None or mesh.dp == 1:
        return loss
    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total, group=mesh.dp_group)
    return float(total.item()) / mesh.dp


def _full_grads(built) -> dict:
    return {n: None if p.grad is None else full_tensor(p.grad).detach().cpu().clone()
            for s in built for n, p in s.named_parameters()}


def _vocab_tables(cfg: TrainConfig, setup) -> tuple[dict, dict]:
    """--vocab-parallel: the tables' (gradients, weights) now, gathered whole by their names
    (every pipeline rank takes part); ({}, {}) without it."""
    if setup.vocab is None:
        return {}, {}
    return full_tables(cfg.model.spec(), setup.vocab, setup.pp_group)


def _full_params(built) -> dict:
    return {n: full_tensor(p).detach().cpu().clone() for s in built for n, p in s.named_parameters()}


def _static_now(built, optimizer) -> int:
    """Parameter, gradient and optimizer-state bytes this rank holds now (after the step)."""
    tensors = [t for s in built for p in s.parameters() for t in (p, p.grad)]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return held_bytes(tensors)


def _predict_static(cfg: TrainConfig, program, rank: int, replica: int, shapes) -> tuple[int, int]:
    """(first step, later steps) predicted peak static bytes of this rank."""
    return tuple(
        predict_static_peak(program, rank, shapes, cfg.sharding, dp=cfg.dp, dp_rank=replica,
                            precision=cfg.precision, optimizer_state=held)
        for held in (False, True)
    )


def chunk_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers whose state is saved: one per chunk (ZeRO-1: its local partition's)."""
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
    return sharded.load_sharded(directory, step=step, stages=stages, optimizers=chunk_optimizers(optimizer))


def _device_max_bytes(device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda" else None


def _dp_link(cfg: TrainConfig, setup) -> tuple[float, float] | None:
    """The DP link the report's simulated column models: the emulated one, or one measured
    on the dp group (with replicas, outside --verify)."""
    if cfg.emulation is not None and cfg.emulation.link is not None:
        return cfg.emulation.link
    if setup.mesh is not None and cfg.dp > 1 and not cfg.verify:
        return measure_link(setup.mesh.dp_group)
    return None


def _check_note(check, clip_grad: float | None) -> str:
    if check.outcome == "skipped":
        return "  skipped (non-finite gradient)"
    if clip_grad is None:
        return ""
    return f"  norm {check.norm:.3g}" + (" clipped" if check.outcome == "clipped" else "")
