"""Shared by the runtime tests: schedules to run, the rank worker, the single-process reference.

Workers run in spawned processes, so they live here at module level (importable by name).
"""
from __future__ import annotations

import torch

from pipeblocks import schedules
from pipeblocks.core import Action, Kind, Placement, Schedule, ScheduleError
from pipeblocks.runtime import PipelineRunner
from pipeblocks.models.toy import ToyConfig, cross_entropy, toy_batch, toy_stages

CONFIG = ToyConfig(vocab=11, hidden=8, blocks_per_stage=1, seq=5)
MICROBATCH = 2  # samples per microbatch
SEQ_CONFIG = ToyConfig(vocab=11, hidden=8, seq=8)  # data for sequence-chunk schedules (GPT stages)


def model_for(schedule: Schedule) -> tuple[list[torch.nn.Module], ToyConfig, object]:
    """(all stages, data config, loss): the attention-free toy model, or, for a schedule with
    sequence chunks (which needs causal attention over earlier chunks), the reference GPT."""
    if schedule.seq_chunks == 1:
        return toy_stages(schedule.num_stages, CONFIG), CONFIG, cross_entropy
    from pipeblocks.models import GPT, GPTConfig, split_stages
    from pipeblocks.models import cross_entropy as gpt_loss

    cfg = GPTConfig(layers=schedule.num_stages, hidden=8, heads=2, seq=SEQ_CONFIG.seq, vocab=SEQ_CONFIG.vocab,
                    dtype="float64")
    return split_stages(cfg, GPT(cfg, seed=0), schedule.num_stages), SEQ_CONFIG, gpt_loss


def split_later(schedule: Schedule) -> Schedule:
    """Every fused BW becomes B at its place and W at the end of the rank (B/W split, W deferred)."""
    ranks = []
    for actions in schedule.ranks:
        front = [a.with_kind(Kind.B) if a.kind is Kind.BW else a for a in actions]
        back = [a.with_kind(Kind.W) for a in actions if a.kind is Kind.BW]
        ranks.append(tuple(front + back))
    return Schedule(f"{schedule.name}+split", schedule.p, schedule.m, schedule.placement, tuple(ranks))


def v_gpipe(p: int, m: int, split: bool) -> Schedule:
    """GPipe order on the V placement: the turn of the V hands over on one rank, without comm."""
    placement = Placement.v_shape(p)
    ranks = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        acts = [Action(down, Kind.F, i) for i in range(m)] + [Action(up, Kind.F, i) for i in range(m)]
        for stage in (up, down):
            if split:
                acts += [Action(stage, Kind.B, i) for i in range(m)]
            else:
                acts += [Action(stage, Kind.BW, i) for i in range(m)]
        if split:
            acts += [Action(s, Kind.W, i) for s in (up, down) for i in range(m)]
        ranks.append(tuple(acts))
    return Schedule("v-gpipe" + ("+split" if split else ""), p, m, placement, tuple(ranks))


def build(case: str, p: int, m: int) -> Schedule:
    """A case is a registered name, or one of the extra forms below."""
    if case == "extra:1f1b+split":
        return split_later(schedules.get("1f1b")(p=p, m=m))
    if case == "extra:v-gpipe":
        return v_gpipe(p, m, split=False)
    if case == "extra:v-gpipe+split":
        return v_gpipe(p, m, split=True)
    return schedules.get(case)(p=p, m=m)


EXTRA = ["extra:1f1b+split", "extra:v-gpipe", "extra:v-gpipe+split"]


def exact_worker(ctx, cases: list[tuple[str, int]]) -> dict:
    """Run each (case, m) for two steps; return the second step's loss and gradients per stage."""
    out = {}
    for case, m in cases:
        schedule = build(case, ctx.world_size, m)
        stages, config, loss_fn = model_for(schedule)
        mine = {s: stages[s] for s in schedule.placement.stages_of(ctx.rank)}
        runner = PipelineRunner(schedule, mine, loss_fn, timeout_s=30.0)
        x0, y0 = toy_batch(MICROBATCH * m, config, seed=1)
        runner.step(x0, y0)
        for module in mine.values():
            module.zero_grad(set_to_none=True)
        x1, y1 = toy_batch(MICROBATCH * m, config, seed=2)
        result = runner.step(x1, y1)
        out[case] = {
            "loss": result.loss,
            "grads": {s: [p.grad.clone() for p in mod.parameters()] for s, mod in mine.items()},
            "peak": result.peak_saved_bytes,
        }
    return out


def reference(case: str, p: int, m: int) -> tuple[float, dict[int, list[torch.Tensor]]]:
    """One process, the whole model, the whole batch (the second step's batch)."""
    schedule = build(case, p, m)
    stages, config, loss_fn = model_for(schedule)
    x, y = toy_batch(MICROBATCH * m, config, seed=2)
    h = x
    for stage in stages:
        h = stage(h)
    loss = loss_fn(h, y)
    loss.backward()
    return loss.item(), {s: [q.grad for q in mod.parameters()] for s, mod in enumerate(stages)}


def try_build(case: str, p: int, m: int) -> str | None:
    """None if the case builds for (p, m) and the runtime can run it, else the reason."""
    try:
        schedule = build(case, p, m)
    except ScheduleError as err:
        return f"the generator rejects p={p}, m={m}: {err}"
    if schedule.chains > 1:
        return "two directions, each stage held twice: its reference and copies are test_dualpipe_runtime's"
    return None


# ---- failure workers ------------------------------------------------------------
class Explodes(torch.nn.Module):
    """Wraps a stage; raises on its `at`-th forward call."""

    def __init__(self, inner: torch.nn.Module, at: int) -> None:
        super().__init__()
        self.inner = inner
        self.at = at
        self.calls = 0

    def forward(self, x):
        if x.device.type != "meta":  # the shape pass may run the module on meta first
            self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("stage exploded on purpose")
        return self.inner(x)


def raising_worker(ctx, raising_rank: int, timeout_s: float) -> None:
    schedule = schedules.get("1f1b")(p=ctx.world_size, m=4)
    stages = toy_stages(schedule.num_stages, CONFIG)
    mine = {s: stages[s] for s in schedule.placement.stages_of(ctx.rank)}
    if ctx.rank == raising_rank:
        mine = {s: Explodes(mod, at=3) for s, mod in mine.items()}
    runner = PipelineRunner(schedule, mine, cross_entropy, timeout_s=timeout_s)
    x, y = toy_batch(MICROBATCH * 4, CONFIG)
    for _ in range(3):
        runner.step(x, y)


def mismatch_worker(ctx) -> None:
    """Stage 1 is built for a wider hidden size than stage 0 produces."""
    schedule = schedules.get("1f1b")(p=2, m=2)
    narrow = toy_stages(2, CONFIG)
    wide = toy_stages(2, ToyConfig(vocab=CONFIG.vocab, hidden=2 * CONFIG.hidden, seq=CONFIG.seq))
    mine = {0: narrow[0]} if ctx.rank == 0 else {1: wide[1]}
    runner = PipelineRunner(schedule, mine, cross_entropy, timeout_s=60.0)
    x, y = toy_batch(MICROBATCH * 2, CONFIG)
    runner.step(x, y)


def silent_peer_worker(ctx, timeout_s: float) -> None:
    """Rank 1 never runs its side; rank 0 must give up after timeout_s, not hang."""
    import time

    if ctx.rank == 1:
        time.sleep(600)
        return
    schedule = schedules.get("1f1b")(p=2, m=2)
    stages = toy_stages(2, CONFIG)
    runner = PipelineRunner(schedule, {0: stages[0]}, cross_entropy, timeout_s=timeout_s)
    x, y = toy_batch(MICROBATCH * 2, CONFIG)
    runner.step(x, y)


def dying_worker(ctx) -> None:
    import os
    import time

    if ctx.rank == 1:
        os._exit(3)
    time.sleep(600)


def bad_input_worker(ctx) -> str:
    """Errors on bad arguments are ValueErrors raised before any communication."""
    schedule = schedules.get("1f1b")(p=2, m=4)
    stages = toy_stages(2, CONFIG)
    messages = []
    try:
        PipelineRunner(schedule, {1 - ctx.rank: stages[1 - ctx.rank]}, cross_entropy)
    except ValueError as err:
        messages.append(str(err))
    runner = PipelineRunner(schedule, {ctx.rank: stages[ctx.rank]}, cross_entropy, timeout_s=30.0)
    x, y = toy_batch(MICROBATCH * 4, CONFIG)
    try:
        runner.step(list(x.chunk(4))[:3], list(y.chunk(4))[:3])
    except ValueError as err:
        messages.append(str(err))
    return "\n".join(messages)


# ---- memory ---------------------------------------------------------------------
def memory_config(schedule: Schedule, total_blocks: int) -> ToyConfig:
    """The same model for every schedule: `total_blocks` blocks cut into the schedule's stages."""
    if total_blocks % schedule.num_stages:
        raise ValueError(f"{total_blocks} blocks do not split into {schedule.num_stages} stages")
    return ToyConfig(vocab=CONFIG.vocab, hidden=CONFIG.hidden, seq=CONFIG.seq,
                     blocks_per_stage=total_blocks // schedule.num_stages)


def memory_worker(ctx, cases: list[tuple[str, int]], total_blocks: int) -> dict:
    """Per case: this rank's measured peak saved bytes in the second step, and what was left after it."""
    out = {}
    for case, m in cases:
        schedule = build(case, ctx.world_size, m)
        stages = toy_stages(schedule.num_stages, memory_config(schedule, total_blocks))
        mine = {s: stages[s] for s in schedule.placement.stages_of(ctx.rank)}
        runner = PipelineRunner(schedule, mine, cross_entropy, timeout_s=30.0)
        x, y = toy_batch(MICROBATCH * m, CONFIG, seed=1)
        runner.step(x, y)
        result = runner.step(x, y)
        out[case] = {"peak": result.peak_saved_bytes, "left": runner.tracker.current}
    return out


# ---- emulation ------------------------------------------------------------------
def emulate_worker(ctx, name: str, m: int, ms: float):
    from pipeblocks.runtime.emulate import EmulatedCompute, EmulatedCosts

    schedule = build(name, ctx.world_size, m)
    stages = toy_stages(schedule.num_stages, CONFIG)
    mine = {s: stages[s] for s in schedule.placement.stages_of(ctx.rank)}
    compute = EmulatedCompute(EmulatedCosts(ms, ms, ms), mine, schedule.num_stages)
    runner = PipelineRunner(schedule, mine, cross_entropy, timeout_s=30.0, compute=compute, record_timeline=True)
    x, y = toy_batch(MICROBATCH * m, CONFIG)
    runner.step(x, y)
    return runner.step(x, y).timeline
