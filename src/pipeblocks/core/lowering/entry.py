"""The one entry that lowers a Schedule for a run: which passes, in which order.

Every consumer of a Program (the simulator, the runtime, `show --program`, `export`, the
memory estimate, the dry run, the emulated-mesh prediction, the asynchronous programs)
lowers through `lower_for`, so they hold the same Program by construction::

    program = lower_for(schedule, policies=parse_sharding("zero3"), dp=2, recompute=[(0, 1)])

The passes, in order (`lower.lower` runs them):

    add_p2p                         sends and receives (`lower.PASSES`)
    dp_passes(policies, dp, units)  UNSHARD/RESHARD for zero3 stages, REDUCE_GRAD
                                    (`dp_passes_at_end` with reduce_at_end), one op per
                                    unit of `units` (`dp_units`; None: per stage): only when
                                    the mesh needs DP ops (`passes_dp.needs_dp_ops`)
    add_recompute(pairs, at)        RECOMPUTE before each chosen pair's first backward, or
                                    earlier, before the action `recompute_at` names
    extra_passes                    what the caller adds (the optimizer steps of an
                                    asynchronous program)
    fuse_overlaps                   each overlapped forward and the backward after it
                                    become one op (`overlap.py`): only when the schedule
                                    marks pairs

Recomputation: the pairs given, or when none are given the schedule's own
(`recompute.recompute_pairs`: every pair for a schedule whose options say recompute="all", as
`1f1b-r`). The placement checks of the ops a pass added (`check_dp_ops`,
`check_recompute`) always run: they are linear scans, as cheap as the passes. `check`
adds the schedule's structure and the deadlock check, as before a launch; the simulator
leaves it off (it finds a deadlock itself, and stays fast).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..ir.actions import Action
from ..ir.dp_units import DPUnits
from .lower import PASSES, Pass, check_deadlock, lower
from ..ir.ops import UnknownOpError
from .overlap import fuse_overlaps
from .passes_dp import check_dp_ops, dp_passes, dp_passes_at_end
from ..ir.program import Program
from .recompute import Pair, add_recompute, check_recompute, recompute_pairs
from ..cost.costs import Costs
from ..ir.schedule import Schedule
from ..ir.sharding import ShardingPolicy, per_stage
from .validate import check_structure
from .vocab_place import add_vocab

__all__ = ["lower_for"]


def lower_for(
    schedule: Schedule,
    *,
    policies: Iterable[ShardingPolicy | str] = (),
    dp: int = 1,
    recompute: Iterable[Pair] | None = None,
    recompute_at: Mapping[tuple[int, int, int], Action] | None = None,
    reduce_at_end: bool = False,
    units: DPUnits | None = None,
    extra_passes: Sequence[Pass] = (),
    check: bool = False,
    vocab: Costs | None = None,
    simulate: Callable[[Program, Costs], Any] | None = None,
) -> Program:
    """The Program of `schedule` on a mesh of `dp` replicas with sharding `policies` (one
    for every stage or one per stage; none: replicate), recomputing `recompute` (or the
    schedule's own pairs, `recompute.recompute_pairs`).

    recompute_at: where a unit's RECOMPUTE runs when not just before its first backward: the
        compute action it precedes (`recompute.add_recompute`; `resolve.recompute_place` chooses).
    reduce_at_end: every REDUCE_GRAD at the end of the rank's step (the no-overlap baseline)
        instead of after its stage's last weight gradient.
    units: the DP units of every stage (`dp_units.units_for`: None at chunk grain): one
        UNSHARD, REDUCE_GRAD and RESHARD per unit of a stage that has several.
    extra_passes: run after the others, in order.
    check: also prove the schedule's structure (`validate.check_structure`) before lowering
        and the Program free of deadlock (`lower.check_deadlock`) after, as a launch needs.
    vocab: costs whose `vocab` is set: vocabulary parallelism, the IF, S, T and IB passes
        inserted last (`vocab_place.add_vocab`, which times them with these costs and may
        hold one more microbatch in flight: the Program's schedule is then that one).
    simulate: with `vocab`, the simulation that times the passes, `simulate(program, costs)`
        -> its Timeline (`simulator.simulate.simulate_program`); the caller passes it, as the
        simulator sits above lowering.
    """
    if vocab is not None and vocab.vocab is not None:
        if simulate is None:
            raise TypeError("lower_for(vocab=...) places the vocabulary passes on a simulated timeline: "
                            "pass simulate=simulate_program (pipeblocks.core.simulator.simulate)")

        def relower(other: Schedule) -> Program:
            return lower_for(other, policies=policies, dp=dp, recompute=recompute, reduce_at_end=reduce_at_end,
                             units=units, extra_passes=extra_passes, check=True)

        return add_vocab(lower_for(schedule, policies=policies, dp=dp, recompute=recompute, recompute_at=recompute_at,
                                   reduce_at_end=reduce_at_end, units=units, extra_passes=extra_passes, check=check),
                         vocab, simulate=simulate, relower=None if recompute_at else relower)
    if check:
        check_structure(schedule)
    stage_policies = per_stage(tuple(policies), schedule.num_stages) if policies else ()
    dp_lowering = (dp_passes_at_end if reduce_at_end else dp_passes)(stage_policies, dp, units)
    pairs = recompute_pairs(schedule, recompute)
    if schedule.overlapped and (pairs or extra_passes):
        raise UnknownOpError(
            f"schedule {schedule.name!r} runs overlapped forward-backward pairs, which "
            + ("recomputation" if pairs else "an asynchronous program's optimizer steps")
            + " does not handle: drop --recompute / --async, or choose a schedule without pairs (zb-v, v-half)"
        )
    passes = PASSES + dp_lowering + ((add_recompute(pairs, recompute_at),) if pairs else ()) + tuple(extra_passes)
    if schedule.overlapped:
        passes += (fuse_overlaps,)
    program = lower(schedule, passes)
    if check:
        check_deadlock(program)
    if dp_lowering:
        check_dp_ops(program, stage_policies or None, units)
    if pairs:
        check_recompute(program)
    return program
