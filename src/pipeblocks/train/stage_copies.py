"""DualPipe's stage copies in `pipeblocks train`: each model stage built once per direction.

A schedule of several chains (`Schedule.chains`, DualPipe's 2) has S = chains x L global
stages for a model cut into L stages: stage s runs model stage s mod L. DualPipe at p = 4
(L = 4, S = 8, the V placement):

    rank 0: stages 0, 7  ->  model stages 0, 3
    rank 1: stages 1, 6  ->  model stages 1, 2
    rank 2: stages 2, 5  ->  model stages 2, 1
    rank 3: stages 3, 4  ->  model stages 3, 0

The model spec fills every parameter by its name from the seed, so building model stage j on
two ranks gives two equal copies; the runner sums their gradients before every step
(`runtime.copies.StageCopies`), so they stay equal. A rank's module of stage s is model stage
s mod L (its `index`: the embedding on model stage 0, the head on L-1), keyed by s.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from ..core.ir.schedule import Schedule
from ..core.cost.split import stage_layers

__all__ = ["build_copies", "copy_layers", "model_stages", "one_chain", "per_chain"]


def model_stages(schedule: Schedule) -> int:
    """L: the stages the model is cut into (the global stages of one chain)."""
    return schedule.num_stages // schedule.chains


def copy_layers(layers: int, schedule: Schedule) -> tuple[int, ...]:
    """Layers of every global stage: the even rule over the model's L stages, once per chain."""
    return stage_layers(layers, model_stages(schedule)) * schedule.chains


def build_copies(spec: Any, schedule: Schedule, stages: Sequence[int], *, seed: int, device=None, dtype=None) -> dict:
    """Global stage -> its module, for `stages` of a schedule of several chains: model stage
    s mod L built from the seed (each only once here; a second copy on the same rank is a deep
    copy of the first)."""
    from ..models.build import build_stages

    length = model_stages(schedule)
    wanted = sorted({s % length for s in stages})
    built = build_stages(spec, seed=seed, num_stages=length, stages=wanted, device=device, dtype=dtype,
                         counts=stage_layers(spec.shape.layers, length))
    by_model = {stage.index: stage for stage in built}
    modules, used = {}, set()
    for s in sorted(stages):
        j = s % length
        modules[s] = copy.deepcopy(by_model[j]) if j in used else by_model[j]
        used.add(j)
    return modules


def one_chain(schedule: Schedule, stages: Sequence) -> list:
    """The global stages of the first chain (all of them for one chain): what a profile
    runs through in order, as model stage L-1's output is no input of model stage 0."""
    return list(stages)[:model_stages(schedule)]


def per_chain(schedule: Schedule, per_stage: Sequence) -> tuple:
    """Figures of one chain's stages, repeated for every chain (a copy costs what it copies)."""
    return tuple(per_stage) * schedule.chains
