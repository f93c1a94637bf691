"""Emulated compute: every action sleeps for its modelled cost while real tensors cross the wire.

With `PipelineRunner(..., compute=EmulatedCompute(costs, stages))` the runner executes the
schedule exactly as in training (same Program, same receives, sends, hand-overs and
waits, tensors of the real shapes and dtypes), but a forward sleeps `f_ms` per layer and
returns zeros of the stage's output spec (a tensor, tuple or dict, as the module returns),
B sleeps `b_ms` per layer and returns a zero gradient of the input (shapes.py), W sleeps
`w_ms` per layer, and a fused BW sleeps B + W. Under vocabulary parallelism
(`vocab_parallel=True`, with `vocab_emulate.EmulatedVocabStep` for the IF, S, T and IB
passes) no stage holds the loss: the last stage returns zeros of its output X like any
other stage, and stage 0's backward returns a zero gradient of its input (the embedding
output, whose gradient the IB passes take). Comparing the
measured Timeline with `simulate(schedule, costs.sim_costs(schedule))` shows the runtime's
own overhead and bubbles on a machine far smaller than the model.

Sleeps are precise (`precise_sleep`): `time.sleep` alone overshoots by 0.1-0.2 ms (the
timer's slack and wake-up), and every overshoot on the critical path would be charged to
the runtime as bubble, so the last 0.3 ms are spun. No longer: a spin burns a core, and
with p ranks on a machine of fewer cores the spinning ranks take the CPU from the ones
whose transfers and wake-ups are on the critical path (a 1 ms spin at 5 ms per pass kept
0.8 of the 2 cores of a 4-rank run busy).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..core.ir.schedule import Schedule
from ..core.cost.costs import Costs
from .backward import WeightGradWork
from .compute import Unit
from .shapes import ActivationSpec, TensorSpec, infer_output_spec, zero_gradient

__all__ = ["EmulatedCosts", "EmulatedCompute", "precise_sleep"]

_SPIN_S = 0.0003  # the tail that is spun, not slept: timer wake-ups come 0.1-0.2 ms late


def precise_sleep(seconds: float) -> None:
    """Block for `seconds` (wall clock) to within a few microseconds: sleep, then spin the tail."""
    if seconds <= 0:
        return
    deadline = time.perf_counter() + seconds
    if seconds > _SPIN_S:
        time.sleep(seconds - _SPIN_S)
    while time.perf_counter() < deadline:
        pass


@dataclass(frozen=True)
class EmulatedCosts:
    """Per layer, per microbatch: forward, input-gradient and weight-gradient time in ms.

    layers: layers in each global stage (one int for every stage, or one per stage).
    stage_ms: (F, B, W) milliseconds of every global stage per microbatch, instead of the
        per-layer times times the layers: for stages that differ by more than their layer
        counts (the embedding and the head with its loss, as the analytic model prices
        them: `from_costs`). None: the per-layer times.
    """

    f_ms: float
    b_ms: float
    w_ms: float
    layers: int | tuple[int, ...] = 1
    stage_ms: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]] | None = None

    def __post_init__(self) -> None:
        for name in ("f_ms", "b_ms", "w_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 ms, got {getattr(self, name)!r}")
        if self.stage_ms is not None:
            rows = tuple(tuple(float(t) for t in row) for row in self.stage_ms)
            if len(rows) != 3 or len({len(row) for row in rows}) != 1 or not all(t >= 0 for row in rows for t in row):
                raise ValueError("stage_ms must be three rows (F, B, W) of one time >= 0 ms per stage, "
                                 f"got {self.stage_ms!r}")
            object.__setattr__(self, "stage_ms", rows)

    @classmethod
    def from_costs(cls, costs: Costs, schedule: Schedule, *, scale: float = 1.0) -> EmulatedCosts:
        """Sleep each stage's pass times of `costs` for `schedule` (seconds, e.g. the analytic
        model's), times `scale` (0.01: a modelled second lasts 10 ms)."""
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale!r}")
        table = costs.for_schedule(schedule)
        rows = tuple(tuple(t * 1e3 * scale for t in times) for times in (table.f, table.b, table.w))
        return cls(0.0, 0.0, 0.0, stage_ms=rows)  # type: ignore[arg-type]

    def pass_ms(self, kind: str, stage: int, num_stages: int) -> float:
        """Milliseconds of one pass of `kind` (F, R: a recomputed forward, B, W, BW) on `stage`."""
        if self.stage_ms is not None:
            if len(self.stage_ms[0]) != num_stages:
                raise ValueError(f"stage_ms has {len(self.stage_ms[0])} stages for {num_stages}: give one per stage")
            f, b, w = (row[stage] for row in self.stage_ms)
        else:
            n = self.layers_of(stage, num_stages)
            f, b, w = self.f_ms * n, self.b_ms * n, self.w_ms * n
        return {"F": f, "R": f, "B": b, "W": w, "BW": b + w}[kind]

    def layers_of(self, stage: int, num_stages: int) -> int:
        if isinstance(self.layers, int):
            return self.layers
        if len(self.layers) != num_stages:
            raise ValueError(f"layers has {len(self.layers)} entries for {num_stages} stages: give one per stage")
        return self.layers[stage]

    def sim_costs(self, schedule: Schedule, t_comm_ms: float = 0.0) -> Costs:
        """The simulator's costs for the same model, in ms per global stage."""
        S = schedule.num_stages
        return Costs(
            t_f=tuple(self.pass_ms("F", s, S) for s in range(S)), t_b=tuple(self.pass_ms("B", s, S) for s in range(S)),
            t_w=tuple(self.pass_ms("W", s, S) for s in range(S)), t_comm=t_comm_ms,
        )


class EmulatedCompute:
    """Sleeps instead of computing; the modules serve only to infer output shapes.

    vocab_parallel: the stages hold no embedding and no head (`runtime.vocab_step`): the last
    stage ends at its output X (zeros of its output spec, no loss) and stage 0's backward
    gives its input's gradient to the IB passes. False: the last stage is the loss stage.
    """

    def __init__(self, costs: EmulatedCosts, stages: Mapping[int, torch.nn.Module], num_stages: int,
                 device: torch.device | str = "cpu", *, vocab_parallel: bool = False) -> None:
        self.costs = costs
        self.vocab_parallel = bool(vocab_parallel)
        # the stage whose forward ends in the loss (none under vocabulary parallelism), and
        # the first stage whose backward hands its input a gradient
        self._loss_stage = -1 if self.vocab_parallel else num_stages - 1
        self._first_grad = 0 if self.vocab_parallel else 1
        self.stages = stages
        self.num_stages = num_stages
        self.device = torch.device(device)
        self._out: dict[tuple, ActivationSpec] = {}
        # set by a data-parallel run at block grain (`emulated_link.EmulatedLink.run_pass`):
        # it sleeps the pass unit by unit, meeting the units' gathers and reductions
        self.pass_timer: Callable[[int, str, float], None] | None = None

    def _sleep(self, stage: int, kind: str) -> None:
        seconds = self.costs.pass_ms(kind, stage, self.num_stages) / 1000.0
        if self.pass_timer is None:
            precise_sleep(seconds)
        else:
            self.pass_timer(stage, kind, seconds)

    def forward(self, stage: int, x: Any, target: torch.Tensor | None, *, keep: bool = True,
                side: Mapping[str, Any] | None = None) -> tuple[Any, Unit]:
        self._sleep(stage, "F")
        if stage == self._loss_stage:
            return None, Unit(x, x, loss=torch.zeros(()))
        spec = ActivationSpec.of(x)
        key = (stage, spec, tuple((k, TensorSpec.of(v)) for k, v in side.items()) if side else ())
        if key not in self._out:
            self._out[key] = infer_output_spec(self.stages[stage], spec, self.device, side)
        out = self._out[key]
        return out.layout.build([torch.zeros(s.shape, dtype=s.dtype, device=self.device) for s in out.leaves]), Unit(x, x)

    def use_parameters(self, stage: int, params) -> None:
        """A sharded chunk's gathered parameters: nothing to learn, the passes only sleep."""

    def recompute(self, stage: int, unit: Unit) -> None:
        """A recomputation takes the forward's time again."""
        self._sleep(stage, "R")

    def input_grad(self, stage: int, unit: Unit, grad: Any) -> Any:
        self._sleep(stage, "B")
        dx = zero_gradient(unit.inp) if stage >= self._first_grad else None
        unit.root = unit.inp = None
        unit.work = WeightGradWork([])
        return dx

    def weight_grad(self, stage: int, unit: Unit) -> None:
        self._sleep(stage, "W")
        unit.work = None

    def full_backward(self, stage: int, unit: Unit, grad: Any) -> Any:
        self._sleep(stage, "BW")
        dx = zero_gradient(unit.inp) if stage >= self._first_grad else None
        unit.root = unit.inp = None
        return dx
