"""The runtime's compute object for an asynchronous Program: the passes of `AsyncStage`.

`PipelineRunner(program.schedule, stages, loss_fn, program=program, compute=AsyncCompute(...))`
runs an asynchronous Program (`pipeblocks.schedules.asynchronous`) on one rank: the
executor walks the rank's ops in order and calls

    forward(stage, x, target)        F: the stage's AsyncStage records the version it sees
                                     and runs at the mode's forward weights (no graph is
                                     kept: only the stage input, for the backward)
    full_backward(stage, unit, grad) BW: recompute at the mode's backward weights and
                                     backpropagate (AsyncStage.backward)
    optimizer_step(stage, step)      STEP: T1's rate, the step, the next version, T2

exactly as the one-process replay (`reference.replay`) does, so the two agree.

A run may be cut into several Programs that follow each other (a synchronous warm-up of
one-step Programs, then the asynchronous one): `start(program, microbatch_offset,
step_offset)` before each tells the compute where in the whole run it is; the versions it
checks against (`versions`) are those of the whole run.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ...core.actions import Action, Kind
from ...core.program import Program
from ...core.versions import WeightVersions
from ...runtime.compute import Unit
from ...runtime.emulate import EmulatedCompute
from .stage import AsyncStage

__all__ = ["AsyncCompute", "AsyncUnit", "EmulatedAsyncCompute"]


@dataclass
class AsyncUnit(Unit):
    """What F keeps for BW: the stage input (in `inp`), the microbatch and its target."""

    microbatch: int = 0
    target: Tensor | None = None


class AsyncCompute:
    """Runs this rank's AsyncStages for the executor (see the module doc).

    stages: global stage index -> AsyncStage, for this rank's stages.
    versions: the versions of the whole run (warm-up included), from the Programs.
    step_size: microbatches per optimizer step (the loss of each is divided by it).
    on_step: called after every optimizer step (progress reports).
    """

    def __init__(self, stages: Mapping[int, AsyncStage], versions: WeightVersions,
                 loss_fn: Callable[[Tensor, Tensor], Tensor], *, last_stage: int, rank: int,
                 on_step: Callable[[int, int], None] | None = None) -> None:
        self.stages = dict(stages)
        self.versions = versions
        self.loss_fn = loss_fn
        self.last_stage = last_stage
        self.rank = rank
        self.step_size = versions.step_size
        self.on_step = on_step
        self.lrs: dict[int, list[float]] = {s: [] for s in self.stages}
        """per stage, the learning rate of its first parameter group at each step"""
        self._order: dict[int, deque[int]] = {}
        self._mb_offset = 0
        self._step_offset = 0

    def start(self, program: Program, microbatch_offset: int = 0, step_offset: int = 0) -> None:
        """The next Program to run begins at this microbatch and optimizer step of the run."""
        self._order = {s: deque() for s in self.stages}
        for op in program.ranks[self.rank]:
            if type(op) is Action and op.kind is Kind.F:
                self._order[op.stage].append(op.microbatch)
        self._mb_offset = microbatch_offset
        self._step_offset = step_offset

    def forward(self, stage: int, x: Tensor, target: Tensor | None) -> tuple[Tensor | None, Unit]:
        mb = self._mb_offset + self._order[stage].popleft()
        st = self.stages[stage]
        v_f = st.begin(mb)
        self._check(stage, mb, "forward", v_f, self.versions.forward[stage][mb])
        out = st.forward(x, v_f, self.versions.backward[stage][mb])
        if stage != self.last_stage:
            return out, AsyncUnit(x, None, microbatch=mb)
        with torch.no_grad():
            loss = self.loss_fn(out, target)
        return None, AsyncUnit(x, None, loss, microbatch=mb, target=target)

    def full_backward(self, stage: int, unit: Unit, grad: Tensor | None) -> Tensor | None:
        st, mb = self.stages[stage], unit.microbatch
        v_b = st.version
        self._check(stage, mb, "backward", v_b, self.versions.backward[stage][mb])
        v_f = st.end(mb)
        dx = st.backward(unit.inp, v_f, v_b, grad_out=grad, target=unit.target, loss_fn=self.loss_fn,
                         scale=self.step_size, input_grad=stage > 0)
        unit.inp = unit.target = None
        return dx

    def input_grad(self, stage: int, unit: Unit, grad: Tensor | None) -> Tensor | None:
        raise NotImplementedError(
            "asynchronous Programs run with a fused backward (BW): the backward recomputes the forward at the "
            "mode's weights, so there is no graph of the forward to split"
        )

    weight_grad = input_grad

    def optimizer_step(self, stage: int, step: int) -> None:
        step += self._step_offset
        st = self.stages[stage]
        st.step(step)
        self.lrs[stage].append(st.optimizer.param_groups[0]["lr"])
        if self.on_step is not None:
            self.on_step(stage, step)

    def _check(self, stage: int, mb: int, what: str, seen: int, planned: int) -> None:
        if seen != planned:
            raise RuntimeError(
                f"rank {self.rank}: the {what} of microbatch {mb} at stage {stage} sees weight version {seen}, but "
                f"the Program plans {planned}: the ops ran out of the Program's order"
            )


class EmulatedAsyncCompute(EmulatedCompute):
    """Emulated compute (every pass sleeps its modelled time) that also takes the Program's
    optimizer steps, which change nothing: emulated passes make no gradients."""

    def __init__(self, *args, on_step: Callable[[int, int], None] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_step = on_step

    def start(self, program: Program, microbatch_offset: int = 0, step_offset: int = 0) -> None:
        self._step_offset = step_offset

    def optimizer_step(self, stage: int, step: int) -> None:
        if self.on_step is not None:
            self.on_step(stage, self._step_offset + step)
