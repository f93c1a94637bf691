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
one-step Programs, then asynchronous segments ending where the run drains, plan.py):
`start(program, microbatch_offset, step_offset)` before each tells the compute where in
the whole run it is; the versions it checks against (`versions`) are those of the whole run.

With a `Drain` (drain.py) the Program can end early on a stop request: the compute object's
`microbatch_limit()` tells the executor which microbatches never enter, and the optimizer
steps of the steps they belong to are not taken. Every pass and step is timed (`events`,
this Program's, in its own numbering) for the report's measured steady state, and the
last stage's losses are kept per step (`step_loss`).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ...core.ir.actions import Action, Kind
from ...core.ir.ops import OptimizerStep
from ...core.ir.program import Program
from ...core.lowering.versions import WeightVersions
from ...runtime.compute import Unit
from ...runtime.emulate import EmulatedCompute
from .drain import Drain
from .stage import AsyncStage

__all__ = ["AsyncCompute", "AsyncUnit", "EmulatedAsyncCompute"]


@dataclass
class AsyncUnit(Unit):
    """What F keeps for BW: the stage input (in `inp`), the microbatch and its target."""

    microbatch: int = 0
    target: Tensor | None = None


class _ProgramWindow:
    """What both computes keep of the running Program: where it starts in the run, the order of
    this rank's forwards per stage, and the drain (None: never) that may end it early."""

    drain: Drain | None
    step_size: int
    _mb_offset = _step_offset = _end = 0

    def _begin(self, program: Program, rank: int, microbatch_offset: int, step_offset: int) -> None:
        self._order: dict[int, deque[int]] = {}
        for op in program.ranks[rank]:
            if type(op) is Action and op.kind is Kind.F:
                self._order.setdefault(op.stage, deque()).append(op.microbatch)
        self._mb_offset, self._step_offset = microbatch_offset, step_offset
        self._end = microbatch_offset + program.schedule.m
        self.events = []

    def microbatch_limit(self) -> int | None:
        """The first microbatch of the running Program that a drain keeps out (None: none)."""
        return None if self.drain is None else self.drain.limit(self._mb_offset)

    def _next_forward(self, stage: int) -> int:
        """The Program's next microbatch at `stage`, told to the drain at the first stage."""
        local = self._order[stage].popleft()
        if stage == 0 and self.drain is not None:
            self.drain.before_first_stage_forward(self._mb_offset + local, self._end)
        return local

    def _drained(self, step: int) -> bool:
        """Whether a drain keeps out microbatches of the Program's `step`: its optimizer step is not taken."""
        limit = self.microbatch_limit()
        return limit is not None and (step + 1) * self.step_size > limit


class AsyncCompute(_ProgramWindow):
    """Runs this rank's AsyncStages for the executor (see the module doc).

    stages: global stage index -> AsyncStage, for this rank's stages.
    versions: the versions of the whole run (warm-up included), from the Programs.
    step_size: microbatches per optimizer step (the loss of each is divided by it).
    on_step: called after every optimizer step with (stage, step of the run) (progress reports).
    drain: ends a Program early on a stop request (None: never).
    """

    def __init__(self, stages: Mapping[int, AsyncStage], versions: WeightVersions,
                 loss_fn: Callable[[Tensor, Tensor], Tensor], *, last_stage: int, rank: int,
                 on_step: Callable[[int, int], None] | None = None, drain: Drain | None = None) -> None:
        self.stages = dict(stages)
        self.versions = versions
        self.loss_fn = loss_fn
        self.last_stage = last_stage
        self.rank = rank
        self.step_size = versions.step_size
        self.on_step = on_step
        self.lrs: dict[int, list[float]] = {s: [] for s in self.stages}
        """per stage, the learning rate of its first parameter group at each step"""
        self.drain = drain
        self.events: list[tuple[Action | OptimizerStep, float, float]] = []
        """this Program's passes and steps (its own numbering), on the perf_counter clock"""
        self.step_loss: dict[int, float] = {}
        """step of the run -> the mean loss of its microbatches (the last stage's rank)"""
        self._losses: dict[int, list[float]] = {}

    def start(self, program: Program, microbatch_offset: int = 0, step_offset: int = 0) -> None:
        """The next Program to run begins at this microbatch and optimizer step of the run."""
        self._begin(program, self.rank, microbatch_offset, step_offset)

    def forward(self, stage: int, x: Tensor, target: Tensor | None) -> tuple[Tensor | None, Unit]:
        local = self._next_forward(stage)
        mb = self._mb_offset + local
        start = time.perf_counter()
        st = self.stages[stage]
        v_f = st.begin(mb)
        self._check(stage, mb, "forward", v_f, self.versions.forward[stage][mb])
        out = st.forward(x, v_f, self.versions.backward[stage][mb])
        if stage != self.last_stage:
            self.events.append((Action(stage, Kind.F, local), start, time.perf_counter()))
            return out, AsyncUnit(x, None, microbatch=mb)
        with torch.no_grad():
            loss = self.loss_fn(out, target)
        self._losses.setdefault(mb // self.step_size, []).append(float(loss))
        self.events.append((Action(stage, Kind.F, local), start, time.perf_counter()))
        return None, AsyncUnit(x, None, loss, microbatch=mb, target=target)

    def full_backward(self, stage: int, unit: Unit, grad: Tensor | None) -> Tensor | None:
        start = time.perf_counter()
        st, mb = self.stages[stage], unit.microbatch
        v_b = st.version
        self._check(stage, mb, "backward", v_b, self.versions.backward[stage][mb])
        v_f = st.end(mb)
        dx = st.backward(unit.inp, v_f, v_b, grad_out=grad, target=unit.target, loss_fn=self.loss_fn,
                         scale=self.step_size, input_grad=stage > 0)
        unit.inp = unit.target = None
        self.events.append((Action(stage, Kind.BW, mb - self._mb_offset), start, time.perf_counter()))
        return dx

    def input_grad(self, stage: int, unit: Unit, grad: Tensor | None) -> Tensor | None:
        raise NotImplementedError(
            "asynchronous Programs run with a fused backward (BW): the backward recomputes the forward at the "
            "mode's weights, so there is no graph of the forward to split"
        )

    weight_grad = input_grad

    def optimizer_step(self, stage: int, step: int) -> None:
        if self._drained(step):
            return  # this step's microbatches never all entered
        start = time.perf_counter()
        local, step = step, step + self._step_offset
        st = self.stages[stage]
        st.step(step)
        self.lrs[stage].append(st.optimizer.param_groups[0]["lr"])
        if stage == self.last_stage and step in self._losses:
            losses = self._losses.pop(step)
            self.step_loss[step] = sum(losses) / len(losses)
        self.events.append((OptimizerStep(stage, local), start, time.perf_counter()))
        if self.on_step is not None:
            self.on_step(stage, step)

    def _check(self, stage: int, mb: int, what: str, seen: int, planned: int) -> None:
        if seen != planned:
            raise RuntimeError(
                f"rank {self.rank}: the {what} of microbatch {mb} at stage {stage} sees weight version {seen}, but "
                f"the Program plans {planned}: the ops ran out of the Program's order"
            )


class EmulatedAsyncCompute(EmulatedCompute, _ProgramWindow):
    """Emulated compute (every pass sleeps its modelled time) that also takes the Program's
    optimizer steps, which change nothing: emulated passes make no gradients. Passes and
    steps are timed, and a drain ends a Program early, as in `AsyncCompute`."""

    def __init__(self, *args, rank: int = 0, on_step: Callable[[int, int], None] | None = None,
                 drain: Drain | None = None, step_size: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rank = rank
        self.lrs: dict[int, list[float]] = {}
        """none: emulated stages have no optimizer"""
        self.on_step = on_step
        self.drain = drain
        self.step_size = step_size
        self.events: list[tuple[Action | OptimizerStep, float, float]] = []
        self.step_loss: dict[int, float] = {}

    def start(self, program: Program, microbatch_offset: int = 0, step_offset: int = 0) -> None:
        self._begin(program, self.rank, microbatch_offset, step_offset)

    def forward(self, stage: int, x, target, **kwargs):
        local = self._next_forward(stage)
        start = time.perf_counter()
        out, unit = super().forward(stage, x, target, **kwargs)
        unit.microbatch = local
        self.events.append((Action(stage, Kind.F, local), start, time.perf_counter()))
        return out, unit

    def full_backward(self, stage: int, unit: Unit, grad):
        start = time.perf_counter()
        local = unit.microbatch
        dx = super().full_backward(stage, unit, grad)
        self.events.append((Action(stage, Kind.BW, local), start, time.perf_counter()))
        return dx

    def optimizer_step(self, stage: int, step: int) -> None:
        if self._drained(step):
            return
        now = time.perf_counter()
        self.events.append((OptimizerStep(stage, step), now, now))
        if self.on_step is not None:
            self.on_step(stage, self._step_offset + step)
