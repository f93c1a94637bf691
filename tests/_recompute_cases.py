"""Shared by the runtime recomputation tests: the cases and the rank worker (spawned
processes import it by name).

A case is (name, schedule, pairs): `pairs` None lets the runner take the schedule's own
(`1f1b-r` recomputes every pair), "all" every pair, else the listed (stage, microbatch).
"""
from __future__ import annotations

import torch

from pipeblocks import schedules
from pipeblocks.core.ir.ops import Recompute
from pipeblocks.core.lowering.recompute import all_pairs
from pipeblocks.models.toy import ToyConfig, cross_entropy, toy_batch, toy_stages
from pipeblocks.core.cost.costs import Costs
from pipeblocks.runtime import PipelineRunner
from pipeblocks.resolve.recompute_place import place_recompute

P, M = 2, 4
MICROBATCH = 2
BLOCKS = 4  # the same model cut into 2 or 4 stages
CONFIG = ToyConfig(vocab=11, hidden=8, seq=5)

CASES = {
    # name: (schedule, pairs)
    "1f1b-r": ("1f1b-r", None),
    "1f1b": ("1f1b", ()),
    "zb-h1+all": ("zb-h1", "all"),  # split B/W: W after the recomputed graph's B
    "zb-h1": ("zb-h1", ()),
    "interleaved+some": ("interleaved-1f1b", ((0, 0), (1, 3), (2, 1), (3, 2), (3, 3))),
    "v-half+all": ("v-half", "all"),  # two stages of one rank hand over locally at the V's turn
    "v-half": ("v-half", ()),
    # every pair, 7 of 16 moved into the waits slow transfers leave (resolve.recompute_place)
    "v-half+placed": ("v-half", "all"),
}
PLACED_WITH = {"v-half+placed": Costs(t_comm=1.0)}


def schedule_of(case: str):
    name, _ = CASES[case]
    return schedules.get(name)(p=P, m=M)


def pairs_of(case: str):
    _, pairs = CASES[case]
    if pairs == "all":
        return all_pairs(schedule_of(case))
    return pairs


def anchors_of(case: str) -> dict:
    """Where the case's recomputations run when the simulator moved them into idle time (none: {})."""
    if case not in PLACED_WITH:
        return {}
    return place_recompute(schedule_of(case), PLACED_WITH[case], pairs_of(case))


def config_of(case: str) -> ToyConfig:
    stages = schedule_of(case).num_stages
    return ToyConfig(vocab=CONFIG.vocab, hidden=CONFIG.hidden, seq=CONFIG.seq, blocks_per_stage=BLOCKS // stages)


class Dropped(torch.nn.Module):
    """A stage with dropout on its output: its recomputation must draw the same mask."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(self.inner(x))


def recompute_worker(ctx, cases: list[str]) -> dict:
    """Per case: this rank's loss, gradients, peak saved bytes (second step) and bytes left after it."""
    out = {}
    for case in cases:
        schedule = schedule_of(case)
        config = config_of(case)
        stages = toy_stages(schedule.num_stages, config)
        mine = {s: stages[s] for s in schedule.placement.stages_of(ctx.rank)}
        runner = PipelineRunner(schedule, mine, cross_entropy, timeout_s=30.0, recompute=pairs_of(case),
                                recompute_at=anchors_of(case))
        x0, y0 = toy_batch(MICROBATCH * M, config, seed=1)
        runner.step(x0, y0)
        for module in mine.values():
            module.zero_grad(set_to_none=True)
        x1, y1 = toy_batch(MICROBATCH * M, config, seed=2)
        result = runner.step(x1, y1)
        out[case] = {
            "loss": result.loss,
            "grads": {s: [p.grad.clone() for p in mod.parameters()] for s, mod in mine.items()},
            "peak": result.peak_saved_bytes,
            "left": runner.tracker.current,
            "recomputes": sum(1 for op in runner.program.ranks[ctx.rank] if type(op) is Recompute),
        }
    out["dropout"] = {flag: dropout_run(ctx, flag) for flag in (False, True)}
    return out


def dropout_run(ctx, recompute: bool) -> dict:
    """1F1B on a model with dropout, every pair recomputed or none: loss, gradients and the
    next random number (the generator must end where a run without recomputation leaves it)."""
    schedule = schedules.get("1f1b")(p=P, m=M)
    stages = [Dropped(s) for s in toy_stages(schedule.num_stages, config_of("1f1b"))]
    mine = {s: stages[s] for s in schedule.placement.stages_of(ctx.rank)}
    torch.manual_seed(100 + ctx.rank)
    runner = PipelineRunner(schedule, mine, cross_entropy, timeout_s=30.0,
                            recompute=all_pairs(schedule) if recompute else ())
    x, y = toy_batch(MICROBATCH * M, config_of("1f1b"), seed=3)
    result = runner.step(x, y)
    return {"loss": result.loss, "grads": {s: [p.grad.clone() for p in mod.parameters()] for s, mod in mine.items()},
            "after": torch.rand(()).item()}


def verify_worker(ctx, cfgs: list) -> list:
    """`train --verify`'s rank body for each TrainConfig in turn, in one set of processes."""
    from pipeblocks.train.loop import train_rank

    return [train_rank(ctx, cfg) for cfg in cfgs]
