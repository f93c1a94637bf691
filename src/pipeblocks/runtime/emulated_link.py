"""An emulated data-parallel link: each DP collective also takes its modelled link time.

Under emulated compute (`emulate.EmulatedCompute`) a step's passes sleep their modelled
times; `EmulatedLink` does the same for the DP collectives, so that overlap and exposed
communication can be measured on a machine whose own links are far faster (or slower)
than the one modelled. It is the simulator's communication stream (`core.simulate`) run
in wall-clock time: an op is issued when the Program reaches it, starts when the stream
is free (ops run one at a time, in program order) and ends its modelled duration later
(`core.dp_model`: ring all-reduce, reduce-scatter, all-gather on the link). Nothing runs
in the background: issuing an op only computes its deadline, and whoever needs the op
done (the first pass of a zero3 chunk after its UNSHARD, the end of the step before the
optimizer) sleeps until that deadline.

Every policy runs. Emulated passes make no gradients, so the real collectives behind the
ops (gloo all-reduce, FSDP2's all-gather and reduce-scatter of the tiny stand-in model)
still run but move next to nothing; the modelled time is the link's alone. The runtime
keeps the real calls out of its measured exposed communication under a link, so nothing
is counted twice (they remain in the step time, as the runtime's own overhead).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from ..core.dp_model import DPCostModel
from .emulate import precise_sleep

__all__ = ["EmulatedLink"]


class EmulatedLink:
    """The modelled communication stream of one rank (times in seconds).

    model: the link, replicas, policies and precision (its link in bytes per second and
        seconds per ring step). stage_params: parameters of every global stage.
    """

    def __init__(self, model: DPCostModel, stage_params: Sequence[float]) -> None:
        self.model = model
        self.stage_params = tuple(float(n) for n in stage_params)
        if any(not n >= 0 for n in self.stage_params):
            raise ValueError(f"stage_params must be >= 0 parameters per stage, got {self.stage_params}")
        self.policies = model.policies(len(self.stage_params))
        self._free = 0.0  # when the stream is next idle (perf_counter seconds)
        self._pending: dict[int, float] = {}  # stage -> deadline of its last op

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
