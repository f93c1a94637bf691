"""When a `DataParallel`'s communication overlaps the passes: each unit's reduction launched
inside its stage's last weight-gradient pass (`InPassReductions`), the next step's first
gathers issued right after the chunk's optimizer step (`GathersAhead`), and the log of when
each happened (`DPEvent`).

    events = deque(maxlen=4096)
    in_pass = InPassReductions(launch, events)    # launch(chunk, unit) starts the unit's reduction
    chunk.readiness = in_pass.readiness(chunk)    # per chunk at block grain
    in_pass.plan(ops, chunks)                     # the rank's Program: which passes launch
    in_pass.before_pass(chunk, action); ...; in_pass.after_pass(time.perf_counter())
    ahead = GathersAhead(chunks, events)
    ahead.plan(ops)                               # the UNSHARDs that open the rank's Program
    ahead.issue(stage)                            # after the stage's optimizer step
    ahead.drop()                                  # after the last step

Where a unit's reduction is launched: inside its stage's last weight-gradient pass of the
step (the W or BW that the stage's REDUCE_GRADs follow in the Program, with only sends and
DP ops between), as soon as the pass has accumulated the unit's last gradient
(`dp_units.GradReadiness`, post-accumulate-grad hooks; the pass runs the blocks in reverse,
so the last unit's reduction runs while the pass computes the others, as FSDP2's per-block
reduce-scatters and DDP's buckets do). The REDUCE_GRAD op then finds it in flight and only
does what follows it (zero2 frees the unit's gathered parameters there; the chunk's last
REDUCE_GRAD runs FSDP2's final callback); a unit no pass completed (a stage whose
REDUCE_GRADs sit elsewhere, as under `reduce_at_end`, or a parameter that got no gradient)
is launched by its op, as before. The Program is unchanged.

The next step's first gathers (`gather_ahead`, on by default): the UNSHARDs that open the
rank's Program are issued again as soon as their chunk's optimizer step is done
(`ChunkOptimizers.step` calls back per chunk), not when the next step reaches them; the
next step's UNSHARD finds its gather in flight. FSDP2 registers the gathered parameters
only when the next step's first pass waits for them, so between steps the modules hold
their shards: a checkpoint (the state dict) or an evaluation sees sharded parameters. The
gather's output buffer is held from its issue, and the static bytes count it there (the
measurement adds the buffers of gathers in flight, `dp_units.gathers_in_flight`; the
prediction holds the leading chunks gathered after the optimizer step). After the last step the
gathers stay in flight unless `drop_gathers_ahead` frees them. `events` logs when each of
these happened (`DPEvent`).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Mapping, NamedTuple, Sequence

from ..core.ir.actions import Action, Kind
from ..core.ir.ops import DPOp, Op, Recompute
from ..core.ir.sharding import FSDP_POLICIES
from .dp_chunks import ChunkState, UnitState
from .dp_units import GradReadiness, unsharded_leaves

__all__ = ["DPEvent", "GathersAhead", "InPassReductions"]


class DPEvent(NamedTuple):
    """One entry of `DataParallel.events` (time: perf_counter seconds).

    kind: "reduce_in_pass" (a unit's reduction launched inside its stage's last
    weight-gradient pass), "reduce_at_op" (launched by its REDUCE_GRAD op), "pass_end" (the
    end of a pass that launched reductions), "gather_ahead" (the next step's gather issued
    after the chunk's optimizer step), "unshard_found_ahead" (an UNSHARD op that found its
    gather in flight), "step_start" (stage -1). unit: None for a whole chunk, and for the
    pass and step events."""

    kind: str
    stage: int
    unit: int | None
    time: float


class InPassReductions:
    """Launches each unit's reduction inside its stage's last weight-gradient pass (module
    doc). launch(chunk, unit): start the unit's reduction (the DataParallel samples the
    static bytes first); events: the DataParallel's log, where "pass_end" goes."""

    def __init__(self, launch: Callable[[ChunkState, UnitState], None], events: deque[DPEvent]) -> None:
        self.launch = launch
        self.events = events
        self.last_weight_pass: dict[Action, int] = {}  # per stage at block grain: its reductions launch inside it
        self.armed: ChunkState | None = None

    def readiness(self, chunk: ChunkState) -> GradReadiness:
        """The hooks of a chunk at block grain: each unit's completion calls `launch`."""

        def ready(index: int) -> None:
            self.launch(chunk, chunk.units[index])

        return GradReadiness(chunk.stage, ready)

    def plan(self, ops: Sequence[Op], chunks: Mapping[int, ChunkState]) -> None:
        """The rank's ops of the Program: each stage's REDUCE_GRADs that directly follow a
        weight-gradient pass of the stage (only sends and DP ops between) are launched inside
        that pass, unit by unit, at block grain."""
        self.last_weight_pass = {}
        seen: set[int] = set()
        for i, op in enumerate(ops):
            if type(op) is not DPOp or op.kind != "REDUCE_GRAD" or op.stage in seen or op.stage not in chunks:
                continue
            seen.add(op.stage)
            if chunks[op.stage].units is None:
                continue
            before = next((o for o in reversed(ops[:i]) if type(o) is Action or type(o) is Recompute), None)
            if type(before) is Action and before.stage == op.stage and before.kind in (Kind.W, Kind.BW):
                self.last_weight_pass[before] = op.stage

    def before_pass(self, chunk: ChunkState, action: Action | Recompute | None) -> None:
        """Before the stage's last weight-gradient pass: watch each unit's leaves (the
        gathered parameters under FSDP2), so that `launch` runs as each unit completes."""
        if action is None or self.last_weight_pass.get(action) != chunk.stage:
            return
        self.disarm()
        fsdp = chunk.policy in FSDP_POLICIES
        chunk.readiness.arm([unsharded_leaves(u.fsdp) if fsdp else u.params for u in chunk.units])
        self.armed = chunk

    def after_pass(self, end: float) -> None:
        """After every pass (ended at `end`): a pass that launched reductions ends them."""
        if self.armed is not None:
            chunk, self.armed = self.armed, None
            if chunk.readiness.disarm():
                self.events.append(DPEvent("pass_end", chunk.stage, None, end))

    def disarm(self) -> None:
        """Stop watching (a new pass is armed, or a step failed inside the pass)."""
        if self.armed is not None:
            self.armed.readiness.disarm()
            self.armed = None


class GathersAhead:
    """Issues the gathers that open the rank's Program for the next step as soon as their
    chunk's optimizer step is done (module doc); the UNSHARD op that finds its gather in
    flight clears the chunk's (or unit's) `ahead`."""

    def __init__(self, chunks: Mapping[int, ChunkState], events: deque[DPEvent]) -> None:
        self.chunks = chunks
        self.events = events
        self.leading: tuple[tuple[int, int | None], ...] = ()  # the gathers that open the rank's step

    def plan(self, ops: Sequence[Op]) -> None:
        """The rank's ops of the Program: the UNSHARDs before its first other op."""
        leading = []
        for op in ops:
            if type(op) is not DPOp or op.kind != "UNSHARD":
                break
            if op.stage in self.chunks and self.chunks[op.stage].policy in FSDP_POLICIES:
                leading.append((op.stage, op.unit))
        self.leading = tuple(leading)

    def issue(self, stage: int) -> None:
        """`stage`'s optimizer has stepped: issue the gathers that open the next step for it
        (the rank's leading UNSHARDs of the stage), so the next step's UNSHARD finds them in
        flight. FSDP2 keeps the parameters sharded until they are waited (the next step's
        first pass of the chunk), so a checkpoint or an evaluation in between sees them
        sharded, and the static bytes sampled after the optimizer step do not count them."""
        chunk = self.chunks.get(stage)
        for s, index in self.leading:
            if s != stage:
                continue
            if index is None:
                if chunk.gathered or chunk.unshard_handle is not None:
                    continue
                chunk.unshard_handle = chunk.module.unshard(async_op=True)
                chunk.ahead = True
            else:
                unit = chunk.units[index]
                if unit.gathered or unit.handle is not None:
                    continue
                unit.handle = unit.fsdp.unshard(async_op=True)
                unit.ahead = True
            self.events.append(DPEvent("gather_ahead", stage, index, time.perf_counter()))

    def drop(self) -> None:
        """Wait for the gathers issued ahead and free them again."""
        for chunk in self.chunks.values():
            if chunk.ahead:
                handle, chunk.unshard_handle, chunk.ahead = chunk.unshard_handle, None, False
                handle.wait()
                chunk.module.reshard()
            for unit in chunk.units or ():
                if unit.ahead:
                    handle, unit.handle, unit.ahead = unit.handle, None, False
                    handle.wait()
                    unit.fsdp.reshard()
