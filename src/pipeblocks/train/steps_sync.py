"""The synchronous step strategy of `pipeblocks train`: one whole flushed step per call.

    >>> steps = SyncSteps(ctx, cfg, last_good)     # this rank's stages, optimizer, runner; resumed if asked
    >>> done = steps.run(step)                     # the step's batch through the pipeline, then the optimizer step

`SyncSteps` builds what `rank_setup.setup_rank` builds, an AdamW over the rank's parameters
(one per chunk with data parallelism; through a `PostValidator` otherwise, which clips and
skips a non-finite step on every rank), and a `PipelineRunner`. `run(step)` feeds the batch
`TokenWindows.batch(step, m*b, seed)` (this replica's share of it), settles the tensor-
parallel and tied gradients, steps the optimizer uninterruptibly and returns a `StepDone`;
`last_good` (loop.py) learns each completed step. The loop (loop.py) runs the observers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..data import TokenWindows
from ..runtime.tensor_parallel import settle_partial_grads, tp_local_shape
from . import checkpoint as ckpt
from . import sharded_checkpoint as sharded
from .sharded_checkpoint import uses_sharded_checkpoints
from .config import TrainConfig
from .observers import writes_progress
from .post_validation import PostValidator
from .prepare import run_program
from .rank_setup import setup_rank
from .report import RankResult

__all__ = ["StepDone", "SyncSteps", "chunk_optimizers", "set_lr"]


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

    def run(self, step: int) -> StepDone:
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

    def verify_result(self, step: int, done: StepDone) -> RankResult:
        """--verify: the step is taken; with clipping, the gradients it used (clipped) are compared."""
        cfg, setup, built = self.cfg, self.setup, self.setup.stages
        grads = done.grads if done.grads is not None else {**_full_grads(built), **_vocab_tables(cfg, setup)[0]}
        return RankResult(setup.rank, tuple(setup.modules), ((step, done.loss),) if done.loss is not None else (),
                          grads=grads, params={**_full_params(built), **_vocab_tables(cfg, setup)[1]},
                          checks=() if done.check is None or cfg.clip_grad is None else ((step, done.check),),
                          dp_rank=setup.replica, static_bytes_measured=self.static,
                          static_bytes_predicted=self.static_predicted[0], tp_rank=setup.tp_rank)


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
    else:
        step = _resume(cfg, ctx, setup.modules, optimizer, setup.data.source)
    if setup.tied is not None:  # the checkpoint holds a tied weight once, on the first stage
        setup.tied.copy_first_to_last()
    return step


def _runner(cfg: TrainConfig, ctx, setup):
    """This rank's PipelineRunner over its stages (emulated compute under `cfg.emulation`)."""
    from ..runtime import PipelineRunner

    compute = _emulated_compute(cfg, setup.modules, ctx.device) if cfg.emulation is not None else None
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




def chunk_optimizers(optimizer) -> list[torch.optim.Optimizer]:
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
    return sharded.load_sharded(directory, step=step, stages=stages, optimizers=chunk_optimizers(optimizer))


def _emulated_compute(cfg: TrainConfig, stages, device):
    from ..runtime.emulate import EmulatedCompute
    from .rank_setup import emulated_costs

    return EmulatedCompute(emulated_costs(cfg), stages, cfg.num_stages, device,
                           vocab_parallel=cfg.schedule.vocab_parallel)
