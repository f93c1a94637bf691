"""Exposed DP communication measured on an emulated mesh, beside the simulator's prediction
(shared by the tests and by benchmarks/mesh.py and benchmarks/pipemesh.py).

Every pass sleeps its modelled time (`runtime.emulate`) and every DP collective takes its
modelled link time (`runtime.emulated_link`), on a real p x d mesh of local processes, so
the measured step time and exposed communication can be set against `simulate_program` of
the same Program with the same costs. The model that runs is tiny (it only gives the
activations their shapes); `stage_params` is the size the link model moves per stage.

    case = EmulatedMeshCase("zb-v", p=2, dp=2, m=4, f_ms=4, b_ms=4, w_ms=4,
                            stage_params=(2e6,) * 4, bandwidth=1e9)
    block = dataclasses.replace(case, blocks=4, dp_unit="block")   # 4 blocks per stage, a unit each
    measured = measure_emulated_mesh(case)      # spawns p x d processes
    both = measure_emulated_meshes([case, other])  # one launch, steps interleaved
    predicted = predict_emulated_mesh(case)
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from pipeblocks.core.cost.costs import BlockCosts, Costs
from pipeblocks.core.cost.dp_model import DPCostModel, Link
from pipeblocks.core.ir.dp_units import DPUnits, check_dp_unit, check_prefetch, units_for
from pipeblocks.core.lowering.entry import lower_for
from pipeblocks.core.ir.sharding import parse_sharding
from pipeblocks.core.simulator.simulate import simulate_program

__all__ = ["EmulatedMeshCase", "measure_emulated_mesh", "measure_emulated_meshes", "predict_emulated_mesh"]


@dataclass(frozen=True)
class EmulatedMeshCase:
    """One emulated run: schedule, mesh, per-pass times (ms per stage), the link (bytes per
    second, seconds per ring step), the parameters per global stage, the policy, whether
    every reduction waits for the end of the step, and the DP grain: `blocks` equal blocks
    per stage (each 1/blocks of its passes and parameters), one unit each at
    dp_unit="block" (`prefetch`: units gathered ahead, None: all)."""

    schedule: str
    p: int
    dp: int
    m: int
    f_ms: float
    b_ms: float
    w_ms: float
    stage_params: tuple[float, ...]
    bandwidth: float
    latency: float = 0.0
    sharding: str = "replicate"
    reduce_at_end: bool = False
    steps: int = 4
    warmup: int = 1
    options: tuple[tuple[str, object], ...] = ()
    """generator options (e.g. ("v", 2), ("forward_groups", (4, 4)) for elastic)"""
    blocks: int = 1
    dp_unit: str = "chunk"
    prefetch: int | None = None

    def __post_init__(self) -> None:
        if self.steps <= self.warmup:
            raise ValueError(f"steps ({self.steps}) must exceed warmup ({self.warmup}): some steps must be timed")
        if isinstance(self.blocks, bool) or not isinstance(self.blocks, int) or self.blocks < 1:
            raise ValueError(f"blocks must be an integer >= 1 per stage, got {self.blocks!r}")
        check_dp_unit(self.dp_unit)
        check_prefetch(self.prefetch)

    def build_schedule(self):
        from pipeblocks import schedules

        return schedules.get(self.schedule)(p=self.p, m=self.m, **dict(self.options))

    def dp_model(self, num_stages: int) -> DPCostModel:
        if len(self.stage_params) != num_stages:
            raise ValueError(f"stage_params has {len(self.stage_params)} entries for {num_stages} stages")
        return DPCostModel(dp=self.dp, sharding=parse_sharding(self.sharding),
                           link=Link(bandwidth=self.bandwidth, latency=self.latency), unit=self.dp_unit,
                           prefetch=self.prefetch)

    def units(self, num_stages: int) -> DPUnits | None:
        return units_for(self.dp_unit, (self.blocks,) * num_stages, prefetch=self.prefetch)


def predict_emulated_mesh(case: EmulatedMeshCase) -> dict:
    """The simulator's step time and exposed DP communication (seconds, largest over ranks)."""
    schedule = case.build_schedule()
    S = schedule.num_stages
    model = case.dp_model(S)
    # one time per global stage: a scalar would be a full stage's, split among its v chunks
    costs = Costs(t_f=(case.f_ms / 1e3,) * S, t_b=(case.b_ms / 1e3,) * S, t_w=(case.w_ms / 1e3,) * S,
                  params=case.stage_params, data_parallel=model,
                  blocks=BlockCosts.even((case.blocks,) * S, case.stage_params))
    program = lower_for(schedule, policies=model.sharding, dp=case.dp, reduce_at_end=case.reduce_at_end,
                        units=case.units(S))
    timeline = simulate_program(program, costs)
    # a mesh without DP ops (one replica, replicate) has no communication stream: 0 exposed
    return {"step_s": timeline.makespan, "exposed_s": max(timeline.exposed_comm, default=0.0),
            "comm_s": max(timeline.comm_time, default=0.0)}


def _build(case: EmulatedMeshCase, mesh, device):
    """One case's runner and DataParallel on this process's ranks of `mesh`."""
    import torch

    from pipeblocks.core.ir.sharding import per_stage
    from pipeblocks.models import GPTConfig, cross_entropy
    from pipeblocks.models.build import build_stages
    from pipeblocks.runtime import PipelineRunner
    from pipeblocks.runtime.data_parallel import DataParallel
    from pipeblocks.runtime.emulate import EmulatedCompute, EmulatedCosts
    from pipeblocks.runtime.emulated_link import EmulatedLink

    schedule = case.build_schedule()
    S = schedule.num_stages
    model = GPTConfig(layers=S * case.blocks, hidden=8, heads=2, seq=8, vocab=16, dtype="float32")
    mine = schedule.placement.stages_of(mesh.pp_rank)
    built = build_stages(model, seed=0, num_stages=S, stages=mine, device=device)
    stages = {s.index: s for s in built}
    units = case.units(S)
    link = EmulatedLink(case.dp_model(S), case.stage_params, units=units)
    dp = DataParallel(stages, per_stage(parse_sharding(case.sharding), S), mesh.dp_mesh, timeout_s=60,
                      link=link, reduce_at_end=case.reduce_at_end, units=units)
    per_layer = EmulatedCosts(case.f_ms / case.blocks, case.b_ms / case.blocks, case.w_ms / case.blocks,
                              layers=case.blocks)
    compute = EmulatedCompute(per_layer, stages, S, device)
    runner = PipelineRunner(schedule, stages, cross_entropy, group=mesh.pp_group, timeout_s=60,
                            compute=compute, data_parallel=dp)
    x = torch.randint(0, model.vocab, (case.m, model.seq))
    return runner, dp, x


def _worker(ctx, cases: tuple[EmulatedMeshCase, ...]) -> list[list[tuple[float, float]]]:
    import torch

    from pipeblocks.runtime.mesh import init_mesh

    mesh = init_mesh(cases[0].p, cases[0].dp, ctx.device)
    built = [_build(case, mesh, ctx.device) for case in cases]
    out: list[list[tuple[float, float]]] = [[] for _ in cases]
    for i in range(max(case.steps for case in cases)):
        # the cases take turns step by step (in alternating order), so a change in the
        # machine's load falls on all of them alike rather than on whichever ran then
        order = range(len(cases)) if i % 2 == 0 else reversed(range(len(cases)))
        for k in order:
            if i >= cases[k].steps:
                continue
            runner, dp, x = built[k]
            torch.distributed.barrier()  # every step starts together on every rank, as the simulator's
            result = runner.step(x if runner.holds_first_stage else None, x if runner.holds_last_stage else None)
            out[k].append((result.duration_s, dp.wait_s))
            ctx.control.beat()
    return out


def measure_emulated_mesh(case: EmulatedMeshCase, *, timeout_s: float = 120.0) -> dict:
    """Measured step time and exposed DP communication (seconds): per step the largest over
    the p x d ranks, then the median over the steps after the warm-up."""
    return measure_emulated_meshes((case,), timeout_s=timeout_s)[0]


def measure_emulated_meshes(cases, *, timeout_s: float = 120.0) -> list[dict]:
    """`measure_emulated_mesh` of several cases on one p x d mesh (one launch): their steps
    are interleaved, so that they are compared under the same load."""
    from pipeblocks.runtime import spawn

    cases = tuple(cases)
    if not cases:
        raise ValueError("give at least one case to measure")
    meshes = {(case.p, case.dp) for case in cases}
    if len(meshes) > 1:
        raise ValueError(f"cases measured together share one p x dp mesh, got {sorted(meshes)}: measure them apart")
    p, dp = meshes.pop()
    per_rank = spawn(_worker, p * dp, args=(cases,), timeout_s=timeout_s, threads_per_rank=1)
    results = []
    for k, case in enumerate(cases):
        steps = range(case.warmup, case.steps)
        step = [max(r[k][i][0] for r in per_rank) for i in steps]
        exposed = [max(r[k][i][1] for r in per_rank) for i in steps]
        results.append({"step_s": statistics.median(step), "exposed_s": statistics.median(exposed),
                        "steps_s": step})
    return results
