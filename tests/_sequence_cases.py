"""Shared by the sequence-chunk runtime tests: cases, the rank worker, the full-sequence reference.

A case is a schedule name in one of these forms:
    "seq1f1b", "seq1f1b-i"      registered sequence schedules (k from the run)
    "split:<name>"              split_sequence(<name>, ..., seq_chunks=k)
    "seq1f1b+split"             seq1f1b with every BW cut into B in place and W at the rank's end
"""
from __future__ import annotations

import torch

from pipeblocks import schedules
from pipeblocks.core import Kind, Schedule
from pipeblocks.models import GPTConfig, build_stages, cross_entropy
from pipeblocks.models.gpt import GPT
from pipeblocks.runtime import PipelineRunner
from pipeblocks.schedules.sequence import split_sequence
from pipeblocks.sim.analytic import TransformerConfig
from pipeblocks.sim.sequence_split import split_lengths

VOCAB = 11
MICROBATCH = 2


def build(case: str, p: int, m: int, k: int) -> Schedule:
    if case == "seq1f1b+split":
        base = build("seq1f1b", p, m, k)
        ranks = []
        for actions in base.ranks:
            front = [a.with_kind(Kind.B) if a.kind is Kind.BW else a for a in actions]
            back = [a.with_kind(Kind.W) for a in actions if a.kind is Kind.BW]
            ranks.append(tuple(front + back))
        return Schedule("seq1f1b+split", p, m, base.placement, tuple(ranks), seq_chunks=k, options=base.options)
    if case.startswith("split:"):
        return split_sequence(case.removeprefix("split:"), p=p, m=m, seq_chunks=k)
    return schedules.get(case)(p=p, m=m, seq_chunks=k)


def model_config(num_stages: int, seq: int, *, hidden: int = 8, heads: int = 2, layers: int | None = None,
                 dtype: str = "float64") -> GPTConfig:
    return GPTConfig(layers=layers or num_stages, hidden=hidden, heads=heads, seq=seq, vocab=VOCAB, dtype=dtype)


def lengths(cfg: GPTConfig, k: int, how: str) -> tuple[int, ...]:
    analytic = TransformerConfig(layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, seq=cfg.seq, vocab=cfg.vocab)
    return split_lengths(cfg.seq, k, how, analytic)


def batch(cfg: GPTConfig, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (MICROBATCH * m, cfg.seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def sequence_worker(ctx, runs: list[tuple[str, int, int, str]], seq: int) -> dict:
    """Each run (case, m, k, split): two steps (the cache must be empty between them); the
    second step's loss, every gradient by parameter name, and the peak saved bytes."""
    out = {}
    for case, m, k, how in runs:
        schedule = build(case, ctx.world_size, m, k)
        cfg = model_config(schedule.num_stages, seq)
        mine = build_stages(cfg, seed=0, num_stages=schedule.num_stages,
                            stages=schedule.placement.stages_of(ctx.rank))
        stages = {s.index: s for s in mine}
        runner = PipelineRunner(schedule, stages, cross_entropy, timeout_s=60.0, seq_lengths=lengths(cfg, k, how))
        runner.step(*batch(cfg, m, seed=1))
        for stage in mine:
            stage.zero_grad(set_to_none=True)
        result = runner.step(*batch(cfg, m, seed=2))
        out[(case, k, how)] = {
            "loss": result.loss,
            "grads": {n: p.grad.clone() for s in mine for n, p in s.named_parameters()},
            "peak": result.peak_saved_bytes,
        }
    return out


def reference(num_stages: int, m: int, seq: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the whole model, whole sequences (the second step's batch)."""
    cfg = model_config(num_stages, seq)
    model = GPT(cfg, seed=0)
    x, y = batch(cfg, m, seed=2)
    loss = cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def errors_worker(ctx) -> list[str]:
    """Bad sequence-chunk setups on one rank: each must raise ValueError before any step runs."""
    from pipeblocks.models.toy import ToyConfig, toy_stages

    messages = []
    schedule = build("seq1f1b", 1, 2, 4)
    toy = toy_stages(1, ToyConfig(vocab=VOCAB))
    try:
        PipelineRunner(schedule, {0: toy[0]}, cross_entropy, timeout_s=30.0)
    except ValueError as err:
        messages.append(str(err))
    cfg = model_config(1, seq=3)
    stages = {0: build_stages(cfg, seed=0, num_stages=1, stages=[0])[0]}
    runner = PipelineRunner(schedule, stages, cross_entropy, timeout_s=30.0)
    try:
        runner.step(*batch(cfg, 2, seed=1))  # 3 tokens, 4 chunks
    except ValueError as err:
        messages.append(str(err))
    try:
        PipelineRunner(schedule, stages, cross_entropy, timeout_s=30.0, seq_lengths=(2, 0, 1, 0))
    except ValueError as err:
        messages.append(str(err))
    return messages


def memory_worker(ctx, runs: list[tuple[str, int, int, str]], model: dict) -> dict:
    """Per run (case, m, k, split): this rank's peak saved bytes in the second step and what was left after it."""
    out = {}
    for case, m, k, how in runs:
        schedule = build(case, ctx.world_size, m, k)
        cfg = GPTConfig(**model)
        mine = build_stages(cfg, seed=0, num_stages=schedule.num_stages,
                            stages=schedule.placement.stages_of(ctx.rank))
        runner = PipelineRunner(schedule, {s.index: s for s in mine}, cross_entropy, timeout_s=120.0,
                                seq_lengths=lengths(cfg, k, how) if k > 1 else None)
        x, y = batch(cfg, m, seed=1)
        runner.step(x, y)
        result = runner.step(x, y)
        out[(case, k, how)] = {"peak": result.peak_saved_bytes, "left": runner.tracker.current}
    return out


def exact_and_memory_worker(ctx, runs: list[tuple[str, int, int, str]], seq: int,
                            memory_runs: list[tuple[str, int, int, str]], model: dict) -> tuple[dict, dict]:
    """`sequence_worker` and then `memory_worker` in the same processes (one spawn for both)."""
    return sequence_worker(ctx, runs, seq), memory_worker(ctx, memory_runs, model)


def predicted_peaks(case: str, p: int, m: int, k: int, how: str, model: dict,
                    microbatch: int = MICROBATCH) -> tuple[float, ...]:
    """The simulator's per-rank peak, fed per-stage bytes and per-chunk shares profiled from the same model."""
    from pipeblocks.models import split_stages
    from pipeblocks.runtime.profile import profile_chunk_memory, profile_stage_memory
    from pipeblocks.sim import Costs, simulate

    schedule = build(case, p, m, k) if k > 1 else schedules.get(case)(p=p, m=m)
    cfg = GPTConfig(**model)
    stages = split_stages(cfg, GPT(cfg, seed=0), schedule.num_stages)
    x, y = (t[:microbatch] for t in batch(cfg, max(1, -(-microbatch // MICROBATCH)), seed=1))
    profile = profile_stage_memory(stages, x, cross_entropy, y)
    seq_mem = profile_chunk_memory(stages, x, cross_entropy, y, lengths(cfg, k, how)) if k > 1 else None
    costs = Costs(mem_b=tuple(float(s.m_b) for s in profile), mem_w_ratio=1.0, seq_mem=seq_mem)
    return simulate(schedule, costs).peak_activation


def kv_ratio(case: str, p: int, m: int, k: int, model: dict, microbatch: int = MICROBATCH) -> dict:
    """The closed form for rank 0's Seq1F1B peak against 1F1B's, with its parts: the formula
    (k+p-1)/(kp), the K/V fraction of one microbatch's saved bytes on rank 0 (its buffers
    hold 2 x layers x b x seq x hidden values; the rest is profiled), the K/V buffers rank 0
    holds at once, and formula + K/V share (`sim.sequence_split.memory_ratio`)."""
    from pipeblocks.models import split_stages
    from pipeblocks.runtime.profile import profile_stage_memory
    from pipeblocks.sim.sequence_split import kv_buffers_held, memory_ratio

    schedule = build(case, p, m, k)
    cfg = GPTConfig(**model)
    stages = split_stages(cfg, GPT(cfg, seed=0), schedule.num_stages)
    x, y = (t[:microbatch] for t in batch(cfg, max(1, -(-microbatch // MICROBATCH)), seed=1))
    profile = profile_stage_memory(stages, x, cross_entropy, y)
    mine = schedule.placement.stages_of(0)
    saved = sum(profile[s].m_b for s in mine)
    layers = sum(len(stages[s].block_indices) for s in mine)
    kv = 2 * layers * microbatch * cfg.seq * cfg.hidden * cfg.torch_dtype.itemsize
    buffers = kv_buffers_held(schedule, 0)
    return {
        "formula": (k + p - 1) / (k * p), "kv_fraction": kv / saved, "buffers": buffers,
        "formula_kv": memory_ratio(p, k, kv_fraction=kv / saved, buffers=buffers),
    }
