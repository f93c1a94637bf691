"""An emulated data-parallel link: each DP collective also takes its modelled link time.

Under emulated compute (`emulate.EmulatedCompute`) a step's passes sleep their modelled
times; `EmulatedLink` does the same for the DP collectives, so that overlap and exposed
communication can be measured on a machine whose own links are far faster (or slower)
than the one modelled. It is the simulator's communication stream (`core.simulator.simulate`) run
in wall-clock time: an op is issued when the Program reaches it, starts when the stream
is free (ops run one at a time, in program order) and ends its modelled duration later
(`core.cost.dp_model`: ring all-reduce, reduce-scatter, all-gather on the link). Nothing runs
in the background: issuing an op only computes its deadline, and whoever needs the op
done (the first pass of a zero3 chunk after its UNSHARD, the end of the step before the
optimizer) sleeps until that deadline.

At block grain (`units=`, ops that name a unit) the link also times the passes of a stage
with several units (`run_pass`, which `emulate.EmulatedCompute` calls instead of one
sleep): the pass sleeps unit by unit (F in block order, B, W and BW in reverse), waits
where it reaches a unit whose gather is not done, issues a later unit's gather when it
reaches the unit `prefetch` before it, and records when it finishes each unit, where a
REDUCE_GRAD of the unit that follows the pass is issued, as the simulator places them.

Every policy runs. Emulated passes make no gradients, so the real collectives behind the
ops (gloo all-reduce, FSDP2's all-gather and reduce-scatter of the tiny stand-in model)
still run but move next to nothing; the modelled time is the link's alone. The runtime
keeps the real calls out of its measured exposed communication under a link, so nothing
is counted twice (they remain in the step time, as the runtime's own overhead).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.cost.dp_model import DPCostModel
from ..core.ir.dp_units import DPUnits
from .emulate import precise_sleep

__all__ = ["EmulatedLink"]

_WEIGHT = ("W", "BW")


@dataclass
class _Entry:
    """One modelled collective: issued at `issue` (None until its pass reaches its anchor),
    then run on the stream from `start` to `end`."""

    stage: int
    unit: int | None
    kind: str
    duration: float
    issue: float | None
    start: float | None = None
    end: float | None = None


class EmulatedLink:
    """The modelled communication stream of one rank (times in seconds).

    model: the link, replicas, policies and precision (its link in bytes per second and
        seconds per ring step). stage_params: parameters of every global stage.
    units: the DP units (`core.ir.dp_units`; None: chunk grain). unit_params: per global stage,
        the parameters of each unit (default: the stage's split by blocks).
    """

    def __init__(self, model: DPCostModel, stage_params: Sequence[float], *, units: DPUnits | None = None,
                 unit_params: Sequence[Sequence[float]] | None = None) -> None:
        self.model = model
        self.stage_params = tuple(float(n) for n in stage_params)
        if any(not n >= 0 for n in self.stage_params):
            raise ValueError(f"stage_params must be >= 0 parameters per stage, got {self.stage_params}")
        self.policies = model.policies(len(self.stage_params))
        self.units = units
        if units is not None:
            units.check_stages(len(self.stage_params))
            if unit_params is None:
                unit_params = [[self.stage_params[s] * max(n, 1) / max(sum(sizes), 1) for n in sizes]
                               for s, sizes in enumerate(units.sizes)]
        self.unit_params = tuple(tuple(float(n) for n in row) for row in unit_params) if unit_params else None
        self._entries: list[_Entry] = []
        self._resolved = 0  # entries before this index have their start and end
        self._free = 0.0  # when the stream is next idle (perf_counter seconds)
        self._gathers: dict[tuple[int, int | None], _Entry] = {}  # waited by the stage's next pass
        self._deferred: dict[int, list[tuple[_Entry, int]]] = {}  # stage -> (gather, unit whose start issues it)
        self._last_pass: tuple[int, str, dict[int, float]] | None = None  # stage, kind, end of each unit
        self._pass_waits = 0.0

    def issue(self, kind: str, stage: int, unit: int | None = None) -> float | None:
        """Issue `kind` (UNSHARD, RESHARD, REDUCE_GRAD) of `stage` (and `unit`) now; returns
        its deadline (None while it waits for its pass to issue it)."""
        if not 0 <= stage < len(self.stage_params):
            raise ValueError(f"stage {stage} is not one of the {len(self.stage_params)} stages of the emulated link")
        if unit is None:
            params = self.stage_params[stage]
        elif self.unit_params is None or not 0 <= unit < len(self.unit_params[stage]):
            raise ValueError(f"{stage}{kind}.{unit}: the emulated link has no unit {unit} of stage {stage}: give it "
                             "the run's units (EmulatedLink(..., units=))")
        else:
            params = self.unit_params[stage][unit]
        entry = _Entry(stage, unit, kind, self.model.op_time(kind, params, self.policies[stage]), time.perf_counter())
        prefetch = self.units.prefetch if self.units is not None else None
        if kind == "UNSHARD" and unit is not None and prefetch is not None and unit >= prefetch:
            entry.issue = None  # inside the stage's next pass, when it reaches unit - prefetch
            self._deferred.setdefault(stage, []).append((entry, unit - prefetch))
        elif kind == "REDUCE_GRAD" and unit is not None and self._last_pass is not None:
            passed, pass_kind, ends = self._last_pass
            if passed == stage and pass_kind in _WEIGHT and unit in ends:
                entry.issue = ends[unit]  # when the weight-gradient pass finished the unit's blocks
        self._entries.append(entry)
        if kind == "UNSHARD":
            self._gathers[(stage, unit)] = entry
        self._resolve()
        return entry.end

    def _resolve(self) -> None:
        """Start and end the entries in order, as far as their issue times are known."""
        entries = self._entries
        while self._resolved < len(entries) and entries[self._resolved].issue is not None:
            entry = entries[self._resolved]
            entry.start = max(entry.issue, self._free)
            entry.end = self._free = entry.start + entry.duration
            self._resolved += 1

    def _wait(self, entry: _Entry) -> float:
        """Sleep until `entry` is done; returns the seconds slept."""
        self._resolve()
        if entry.end is None:
            raise RuntimeError(f"{entry.stage}{entry.kind}.{entry.unit} waits on a gather issued inside a pass that "
                               "has not run: the Program's order and the link's units disagree")
        wait = entry.end - time.perf_counter()
        precise_sleep(wait)
        return max(wait, 0.0)

    def wait_stage(self, stage: int) -> None:
        """Sleep until every op issued for `stage` has taken its modelled time."""
        self._resolve()
        mine = [e for e in self._entries if e.stage == stage]
        for key in [k for k in self._gathers if k[0] == stage]:
            del self._gathers[key]
        if mine:
            self._wait(max(mine, key=lambda e: e.end if e.end is not None else float("inf")))

    def run_pass(self, stage: int, kind: str, seconds: float) -> None:
        """Sleep `seconds` for a pass of `stage` (`kind`: F, B, W, BW, or R for a
        recomputation), unit by unit at block grain (see the module doc)."""
        if self.units is None or self.units.count(stage) == 1:
            precise_sleep(seconds)
            self._last_pass = None
            return
        sizes = self.units.sizes[stage]
        total = sum(sizes)
        order = range(len(sizes)) if kind in ("F", "R") else reversed(range(len(sizes)))
        deferred = self._deferred.pop(stage, [])
        start = time.perf_counter()
        t = start
        ends: dict[int, float] = {}
        for unit in order:
            for entry, anchor in deferred:
                if anchor == unit:
                    entry.issue = t
            gather = self._gathers.pop((stage, unit), None)
            if gather is not None:
                slept = self._wait(gather)
                self._pass_waits += slept
                t = max(t, time.perf_counter())
            t += seconds * sizes[unit] / total
            precise_sleep(t - time.perf_counter())
            ends[unit] = t
        self._resolve()
        self._last_pass = (stage, kind, ends)

    def take_pass_waits(self) -> float:
        """Seconds the passes waited inside for their units' gathers since the last call."""
        waited, self._pass_waits = self._pass_waits, 0.0
        return waited

    def finish(self, stages: Sequence[int]) -> None:
        """The end of the step: wait for the stream to drain, then take the parameter
        gathers after the optimizer step (zero1, zero2) of `stages`, where nothing overlaps
        them (as the simulator counts them)."""
        self._resolve()
        if self._resolved < len(self._entries):
            left = self._entries[self._resolved]
            raise RuntimeError(f"{left.stage}{left.kind}.{left.unit} was never issued: its stage ran no pass after it")
        end = max(time.perf_counter(), self._free)
        for s in stages:
            end += self.model.after_step_time(self.stage_params[s], self.policies[s])
        precise_sleep(end - time.perf_counter())
        self._free = 0.0
        self._entries.clear()
        self._resolved = 0
        self._gathers.clear()
        self._deferred.clear()
        self._last_pass = None
