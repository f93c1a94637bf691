"""Pass times as a rank of a pipelined run takes them, for `pipeblocks calibrate`.

    >>> passes = measure_in_run("gpt", Shape(64, 64, 2, 4), precision="fp32", threads=1)
    >>> passes["v-half"]["chunks"], passes["v-half"]["passes"]["1F"]   # 2, median seconds of stage 1's F

`calibrate` times each pass alone, back to back on one model (`calibrate.measure_shape`).
Inside a run a rank's passes are interleaved with other microbatches' passes, with the
runtime's sends and receives, and, on a schedule with two chunks per rank (the V shapes,
train's default v-half), with the passes of a second stage whose weights and activations
take the caches in turn. Measured on a 2-core CPU with one thread a rank (GPT, hidden 64):
1F1B's passes take what the alone-timed profile predicts (0.99), v-half's take 1.20 times
it. So `calibrate` runs a few steps of 1F1B and of v-half on two local processes, over a
4-block model of its first shape, and records each pass's median time from the run's own
timeline; the comparison with the profile's prediction for the same passes (the in-run
factor per chunks per rank) is `train.predict.in_run_factors`.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from .. import schedules
from ..core.ir.actions import Action
from ..models.build import build_model, split_stages
from ..models.family import get_family
from .calibrate import COMPUTE_DTYPES, Shape
from .launch import spawn
from .runner import PipelineRunner

__all__ = ["IN_RUN_SCHEDULES", "IN_RUN_LAYERS", "measure_in_run", "in_run_model"]

IN_RUN_SCHEDULES = ("1f1b", "v-half")
"""one schedule per chunks per rank (1 and 2): a rank holding one stage, and one alternating two"""
IN_RUN_LAYERS = 4
"""blocks of the measured model: one per stage of v-half at p = 2, two per stage of 1F1B"""


def in_run_model(family: str, shape: Shape, precision: str, num_stages: int):
    """(the family's spec, its stages in the compute dtype) of the measured model, seed 0."""
    fam = get_family(family)
    config = fam.config(layers=IN_RUN_LAYERS, hidden=shape.hidden, heads=shape.heads, seq=shape.seq, vocab=256,
                        dtype="float64" if precision == "fp64" else "float32")
    spec = fam.spec(config)
    whole = build_model(spec, seed=0).to(dtype=COMPUTE_DTYPES[precision])
    return spec, split_stages(spec, whole, num_stages)


def _worker(ctx, family: str, shape: Shape, precision: str, m: int, steps: int, warmup: int) -> dict | None:

    out = {}
    for name in IN_RUN_SCHEDULES:
        schedule = schedules.get(name)(p=ctx.world_size, m=m)
        spec, stages = in_run_model(family, shape, precision, schedule.num_stages)
        mine = {s: stages[s].to(ctx.device) for s in schedule.placement.stages_of(ctx.rank)}
        runner = PipelineRunner(schedule, mine, spec.loss, rank=ctx.rank, device=ctx.device, record_timeline=True,
                                measure_memory=False, timeout_s=120.0)
        generator = torch.Generator().manual_seed(0)
        times: dict[str, list[float]] = {}
        for step in range(warmup + steps):
            tokens = torch.randint(0, 256, (shape.microbatch * m, shape.seq + 1), generator=generator).to(ctx.device)
            dist.barrier()
            result = runner.step(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
            if result.timeline is not None and step >= warmup:  # the whole step's, on rank 0
                for events in result.timeline.events:
                    for event in events:
                        if type(event.action) is Action:
                            key = f"{event.action.stage}{event.action.kind}"
                            times.setdefault(key, []).append(event.end - event.start)
        out[name] = {"chunks": schedule.num_stages // ctx.world_size,
                     "passes": {key: statistics.median(values) for key, values in sorted(times.items())}}
    return out if ctx.rank == 0 else None


def measure_in_run(family: str, shape: Shape, *, precision: str, threads: int, device: str = "cpu", m: int = 8,
                   steps: int = 10, warmup: int = 2, timeout_s: float = 300.0) -> dict:
    """{schedule: {"chunks": chunks per rank, "passes": {"<stage><kind>": median seconds}}} of
    `steps` steps after `warmup` of each of IN_RUN_SCHEDULES, on two local processes with
    `threads` torch threads each."""
    results = spawn(_worker, 2, args=(family, shape, precision, m, steps, warmup), timeout_s=timeout_s,
                    threads_per_rank=threads, device=torch.device(device).type)
    return results[0]
