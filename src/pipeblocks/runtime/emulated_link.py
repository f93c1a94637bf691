"""An emulated data-parallel link: each DP collective also takes its modelled link time.

Under emulated compute (`emulate.EmulatedCompute`) a step's passes sleep their modelled
times; `EmulatedLink` does the same for the DP collectives, so that overlap and exposed
communication can be measured on a machine whose own links are far faster (or slower)
than the one modelled. It is the simulator's communication stream (`core.simulate`) run
in wall-clock time: an op is issued when the Program reaches it, starts when the stream
is free (ops run one at a time, in program order) and ends its modelled duration later
(`core.dp_model`: ring all-reduce, reduce-scatter, all-gather on the link). Nothing runs
in the background: issuing an op only computes its deadline, and whoever needs the op
done (the end of the step, before the optimizer) sleeps until that deadline.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core.dp_model import DataParallel as DPModel
from ..core.sharding import ShardingPolicy
from .emulate import precise_sleep

__all__ = ["EmulatedLink"]


@dataclass
class EmulatedLink:
    """The modelled communication stream of one rank (times in seconds).

    model: the link, replicas, policies and precision (its link in bytes per second and
        seconds per ring step). stage_params: parameters of every global stage.
    """

    model: DPModel
    stage_params: Sequence[float]
    _free: float = field(default=0.0, init=False)
    _pending: dict[int, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.stage_params = tuple(float(n) for n in self.stage_params)
        if any(n < 0 for n in self.stage_params):
            raise ValueError(f"stage_params must be >= 0 parameters per stage, got {self.stage_params}")
        self.policies = self.model.policies(len(self.stage_params))

    def issue(self, kind: str, stage: int) -> float:
        """Issue `kind` (UNSHARD, RESHARD, REDUCE_GRAD) of `stage` now; returns its deadline."""
        if not 0 <= stage < len(self.stage_params):
            raise ValueError(f"stage {stage} is not one of the {len(self.stage_params)} stages of the emulated link")
        duration = self.model.op_time(kind, self.stage_params[stage], self.policies[stage])
        start = max(time.perf_counter(), self._free)
        self._free = start + duration
        self._pending[stage] = self._free
        return self._free

    def wait_stage(self, stage: int) -> None:
        """Sleep until the last op issued for `stage` has taken its modelled time."""
        deadline = self._pending.pop(stage, None)
        if deadline is not None:
            precise_sleep(deadline - time.perf_counter())

    def finish(self, stages: Sequence[int]) -> None:
        """The end of the step: wait for the stream to drain, then take the parameter
        gathers after the optimizer step (zero1, zero2) of `stages`, where nothing overlaps
        them (as the simulator counts them)."""
        end = max(time.perf_counter(), self._free)
        for s in stages:
            end += self.model.after_step_time(self.stage_params[s], self.policies[s])
        precise_sleep(end - time.perf_counter())
        self._free = 0.0
        self._pending.clear()

    @property
    def supported(self) -> tuple[ShardingPolicy, ...]:
        """Policies the emulated runtime runs: their collectives need no real gradient."""
        return (ShardingPolicy.REPLICATE, ShardingPolicy.ZERO1)
