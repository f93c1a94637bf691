"""A resolved run's Program, lowered in one place: `Lowering` holds what decides it beside the
schedule (sharding per chunk, replicas, DP units, the recomputed pairs and where they run,
the costs the vocabulary passes are placed by).

    >>> program = Lowering.of(schedule, costs, recompute=pairs, recompute_at=at).program(schedule)
    >>> timeline = simulate_run(schedule, costs, recompute=pairs, recompute_at=at)

A run simulated from costs takes them from its costs (`Lowering.of`: `build.Built`, the
choosers, `plan`); `train` fills them from its config (`train.prepare.run_lowering`): the
Program its ranks run (`runtime.PipelineRunner(program=)`) and its dry run prices.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..core.cost.costs import Costs
from ..core.ir.actions import Action
from ..core.ir.dp_units import DPUnits
from ..core.ir.program import Program
from ..core.ir.schedule import Schedule
from ..core.ir.sharding import ShardingPolicy
from ..core.lowering.entry import lower_for
from ..core.lowering.recompute import Pair
from ..core.simulator.simulate import simulate_lowered, simulate_program
from ..core.simulator.timeline import Timeline

__all__ = ["Lowering", "simulate_run"]


@dataclass(frozen=True)
class Lowering:
    """The settings a run's Program is lowered with: the arguments of `core.lowering.entry.lower_for`
    of the same names (`sharding` is its `policies`), which its docstring explains."""

    sharding: tuple[ShardingPolicy | str, ...] = ()
    dp: int = 1
    units: DPUnits | None = None
    recompute: Iterable[Pair] = frozenset()
    recompute_at: Mapping[tuple[int, int, int], Action] = field(default_factory=dict)
    vocab: Costs | None = None

    @classmethod
    def of(cls, schedule: Schedule, costs: Costs, *, recompute: Iterable[Pair] = (),
           recompute_at: Mapping[tuple[int, int, int], Action] | None = None, vocab: bool = True) -> Lowering:
        """A run simulated with `costs`: their mesh and DP units, and their vocabulary passes
        when they price them (`vocab`: False leaves them out, as the recomputation placement does)."""
        dp = costs.data_parallel
        return cls(tuple(dp.sharding), dp.dp, costs.dp_units(schedule.num_stages), recompute, recompute_at or {},
                   costs if vocab and costs.vocab is not None else None)

    def program(self, schedule: Schedule, *, check: bool = False) -> Program:
        """The Program of `schedule` under these settings; `check`: also prove the schedule's
        structure and the Program free of deadlock, as before a launch."""
        return lower_for(schedule, policies=self.sharding, dp=self.dp, recompute=self.recompute,
                         recompute_at=self.recompute_at or None, units=self.units, check=check, vocab=self.vocab,
                         simulate=simulate_program)


def simulate_run(schedule: Schedule, costs: Costs, *, recompute: Iterable[Pair] = (),
                 recompute_at: Mapping[tuple[int, int, int], Action] | None = None) -> Timeline:
    """`schedule` validated and its Program (`Lowering.of` these costs) simulated with `costs`."""
    lowering = Lowering.of(schedule, costs, recompute=recompute, recompute_at=recompute_at)
    return simulate_lowered(schedule, lambda: lowering.program(schedule), costs)
