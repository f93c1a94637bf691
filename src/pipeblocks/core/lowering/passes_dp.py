"""Lowering passes for data-parallel communication: gradient reduction and parameter
gather/free, as ops in the Program (named as torch.distributed.pipelining names them).

`add_grad_reduce` puts one `REDUCE_GRAD` per stage right after that stage's last
weight-gradient pass of the step on its rank (its last W, or last fused BW; with sequence
chunks, whichever chunk's comes last), after the sends that pass posts. The reduction is
launched there on the communication stream and waited on only at the end of the step,
where the optimizer needs it, so it overlaps every compute op that follows.

`add_sharding(policies)` brackets each ZeRO-3 stage with an `UNSHARD` and a `RESHARD`.
The gathers are prefetched one stage ahead, in the order the rank first uses its stages:
the first two at the start of the step, and each later one where the rank starts on the
stage before it (before that stage's first pass and its receives). A gather issued only
one compute action ahead cannot hide behind a forward much shorter than itself; a chunk
change, as Megatron and torch's pipelining do (Megatron gathers chunks 0 and 1 up front,
torch keeps a window of the next stages gathered), gives it a whole visit of the stage
before. The parameters then stay gathered until the stage's last pass of the step;
RESHARD follows its REDUCE_GRAD (one gather and one reduce-scatter per stage per step;
freeing between forward and backward would gather again per microbatch). The memory
model already counts every zero3 stage gathered at the step's peak, so prefetching earlier
changes no memory figure. 1F1B, p=2, m=2, zero3 on both stages::

    0: 0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0BW0 0RECV_B1 0BW1 0REDUCE_GRAD 0RESHARD
    1: 1UNSHARD 1RECV_F0 1F0 1BW0 1SEND_B0 1RECV_F1 1F1 1BW1 1SEND_B1 1REDUCE_GRAD 1RESHARD

`add_grad_reduce_at_end` is the baseline without overlap: every REDUCE_GRAD at the end of
the rank's step, in stage order (what a data-parallel wrapper that reduces once after the
whole pipeline step does); the benchmark compares the two placements.

Units (`dp_units.DPUnits`, block grain): a stage of several units gets one op per unit.
Its units are gathered where the stage's gather goes, in order (`DPUnits.prefetch` = k:
only the first k there, the others right before the stage's first pass, after its
receives, where each is issued inside the pass when it reaches the unit k before it, as
FSDP2 gathers the next block while this one computes). Its
reductions go where the stage's goes, in the order the units' gradients complete (a
backward runs the blocks in reverse), each issued when the weight-gradient pass before it
finishes that unit's blocks; its RESHARDs after them. The simulator and the emulated
link time the passes per block to see this. 1F1B, p=2, m=2, zero3, two blocks per stage::

    0: 0UNSHARD.0 0UNSHARD.1 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0BW0 0RECV_B1 0BW1 0REDUCE_GRAD.1 0REDUCE_GRAD.0 0RESHARD.0 0RESHARD.1
    1: 1UNSHARD.0 1UNSHARD.1 1RECV_F0 1F0 1BW0 1SEND_B0 1RECV_F1 1F1 1BW1 1SEND_B1 1REDUCE_GRAD.1 1REDUCE_GRAD.0 1RESHARD.0 1RESHARD.1

`dp_passes(policies, dp, units)` is the list `lowering.lower_for` appends to
`lower.PASSES`: nothing for a single replicated pipeline, otherwise the passes the
policies need. Both passes work on any Program (before or after `add_p2p`); DP ops never
block on a pipeline peer, so the deadlock check passes over them, and `check_dp_ops`
proves their placement.
"""
from __future__ import annotations

from collections.abc import Iterable

from ..ir.actions import Action, Kind
from ..ir.dp_units import DPUnits
from ..ir.errors import ScheduleError
from ..ir.ops import Comm, DPOp, Op, Recompute, expanded, spliced
from ..ir.program import Program
from ..ir.sharding import ShardingPolicy, per_stage

__all__ = [
    "add_grad_reduce", "add_grad_reduce_at_end", "add_sharding", "check_dp_ops", "dp_passes", "dp_passes_at_end",
    "grad_reduce_pass", "needs_dp_ops", "regather_gaps", "regather_stages", "unit_ids",
]

UNSHARD, RESHARD, REDUCE_GRAD = "UNSHARD", "RESHARD", "REDUCE_GRAD"


def needs_dp_ops(policies: Iterable[ShardingPolicy], dp: int) -> bool:
    """Whether a Program for this mesh holds DP ops: more than one replica, or a policy
    other than replicate (a sharded runtime wants its ops even on one replica)."""
    return dp > 1 or any(ShardingPolicy(p) is not ShardingPolicy.REPLICATE for p in policies)


def regather_stages(schedule) -> frozenset[int]:
    """The stages zero3-regather can apply to: those whose rank runs another stage too (a
    chunk alone on its rank is never left between its passes)."""
    placement = schedule.placement
    return frozenset(s for r in range(schedule.p) if len(placement.stages_of(r)) > 1 for s in placement.stages_of(r))


def unit_ids(units: DPUnits | None, stage: int) -> tuple[int | None, ...]:
    """The unit field of `stage`'s DP ops: (None,) for a stage of one unit (or chunk grain,
    `units` None), else 0, 1, ... in block order."""
    if units is None:
        return (None,)
    n = units.count(stage)
    return (None,) if n == 1 else tuple(range(n))


def dp_passes(policies: Iterable[ShardingPolicy], dp: int, units: DPUnits | None = None) -> tuple:
    """The DP lowering passes for `policies` (one, or one per stage) on `dp` replicas, one
    op per unit of `units` (None: per stage, chunk grain)."""
    policies = tuple(ShardingPolicy(p) for p in policies)
    if not needs_dp_ops(policies, dp):
        return ()
    passes: list = []
    if any(p.shards_parameters for p in policies):
        passes.append(add_sharding(policies, units))
    passes.append(grad_reduce_pass(units))
    return tuple(passes)


def _is_weight_grad(op: Op) -> bool:
    return type(op) is Action and (op.kind is Kind.W or op.kind is Kind.BW)


def _after_sends(ops: tuple[Op, ...], index: int) -> int:
    """The position after ops[index] (a compute action) and the sends it posts."""
    action = ops[index]
    pos = index + 1
    while pos < len(ops):
        op = ops[pos]
        if type(op) is Comm and op.send and op.stage == action.stage and op.microbatch == action.microbatch:
            pos += 1
        else:
            break
    return pos


def _reductions(units: DPUnits | None, stage: int) -> list[Op]:
    """A stage's REDUCE_GRADs in the order its units' gradients complete (the last first)."""
    return [DPOp(REDUCE_GRAD, stage, u) for u in reversed(unit_ids(units, stage))]


def _grad_reduce(program: Program, units: DPUnits | None) -> Program:
    ranks: list[tuple[Op, ...]] = []
    for ops in program.ranks:
        last: dict[int, int] = {}
        for i, op in enumerate(ops):
            if _is_weight_grad(op):
                last[op.stage] = i
        insert_at: dict[int, list[Op]] = {}
        for stage, i in last.items():
            insert_at.setdefault(_after_sends(ops, i), []).extend(_reductions(units, stage))
        ranks.append(spliced(ops, insert_at))
    return Program(program.schedule, tuple(ranks))


def _grad_reduce_at_end(program: Program, units: DPUnits | None) -> Program:
    ranks = []
    for ops in program.ranks:
        stages = sorted({op.stage for op in ops if _is_weight_grad(op)})
        ranks.append((*ops, *(op for s in stages for op in _reductions(units, s))))
    return Program(program.schedule, tuple(ranks))


def add_grad_reduce(program: Program) -> Program:
    """Insert `sREDUCE_GRAD` after each stage's last weight-gradient pass on its rank."""
    return _grad_reduce(program, None)


def add_grad_reduce_at_end(program: Program) -> Program:
    """Insert every stage's `sREDUCE_GRAD` at the end of its rank's ops (no overlap)."""
    return _grad_reduce_at_end(program, None)


def grad_reduce_pass(units: DPUnits | None, *, at_end: bool = False):
    """The REDUCE_GRAD pass, one op per unit of `units` (None: `add_grad_reduce`, or
    `add_grad_reduce_at_end` with `at_end`)."""
    if units is None:
        return add_grad_reduce_at_end if at_end else add_grad_reduce

    def grad_reduce(program: Program) -> Program:
        units.check_stages(program.schedule.num_stages)
        return (_grad_reduce_at_end if at_end else _grad_reduce)(program, units)

    name = "add_grad_reduce_at_end" if at_end else "add_grad_reduce"
    grad_reduce.__name__ = grad_reduce.__qualname__ = name
    return grad_reduce


def dp_passes_at_end(policies: Iterable[ShardingPolicy], dp: int, units: DPUnits | None = None) -> tuple:
    """As `dp_passes`, with the reductions at the end of the step (the no-overlap baseline)."""
    passes = dp_passes(policies, dp, units)
    return passes[:-1] + (grad_reduce_pass(units, at_end=True),) if passes else ()


def add_sharding(policies: Iterable[ShardingPolicy], units: DPUnits | None = None):
    """The pass that gathers each ZeRO-3 stage before its first pass and frees it after
    its last (after its REDUCE_GRAD when that is already placed), one op per unit; a
    zero3-regather stage is also freed and gathered again between its visits
    (`regather_gaps`)."""
    given = tuple(ShardingPolicy(p) for p in policies)

    def add_sharding_pass(program: Program) -> Program:
        policy = per_stage(given, program.schedule.num_stages)
        if units is not None:
            units.check_stages(program.schedule.num_stages)
        ranks: list[tuple[Op, ...]] = []
        for rank, ops in enumerate(program.ranks):
            first: dict[int, int] = {}
            last: dict[int, int] = {}
            group_start: list[int] = []  # per compute action: where its leading receives begin
            previous_group: dict[int, int] = {}
            own_group: dict[int, int] = {}  # where the receives before the stage's first pass begin
            passes: list[int] = []  # the compute actions' positions
            start = 0
            for i, op in enumerate(ops):
                if type(op) is Action or type(op) is Recompute:
                    if op.stage not in first:
                        first[op.stage] = i
                        previous_group[op.stage] = group_start[-1] if group_start else 0
                        own_group[op.stage] = start
                    last[op.stage] = i
                    group_start.append(start)
                    passes.append(i)
                    start = i + 1
                elif not (type(op) is Comm and not op.send):
                    start = i + 1
            insert_at: dict[int, list[Op]] = {}
            in_pass: dict[int, list[Op]] = {}  # right before a stage's first pass, after everything else there
            order = sorted(first, key=first.__getitem__)
            for k, stage in enumerate(order):
                if policy[stage].shards_parameters:
                    ids = unit_ids(units, stage)
                    early = ids if units is None or units.prefetch is None else ids[:units.prefetch]
                    # one stage ahead: where the rank starts on the stage before this one
                    # in first-use order (the step's start for the first two)
                    ahead = own_group[order[k - 1]] if k >= 2 else 0
                    insert_at.setdefault(min(ahead, previous_group[stage]), []).extend(
                        DPOp(UNSHARD, stage, u) for u in early
                    )
                    in_pass.setdefault(first[stage], []).extend(DPOp(UNSHARD, stage, u) for u in ids[len(early):])
                    if policy[stage].regathers:
                        if len(first) == 1:
                            raise ScheduleError(
                                f"--sharding {policy[stage]} on stage {stage}: rank {rank} runs no other chunk, so "
                                "the stage is never left between its passes and nothing can be freed and gathered "
                                f"again; give stage {stage} zero3, or use a schedule with several chunks per rank "
                                "(-v 2, or a V schedule)"
                            )
                        for done, again in regather_gaps(ops, passes, stage):
                            # freed after the visit's last pass and its sends; gathered again
                            # after the other chunks' activations crest, before a pass's receives
                            insert_at.setdefault(_after_sends(ops, passes[done]), []).extend(
                                DPOp(RESHARD, stage, u) for u in ids
                            )
                            insert_at.setdefault(group_start[again], []).extend(DPOp(UNSHARD, stage, u) for u in early)
                            in_pass.setdefault(passes[next(i for i in range(again, len(passes))
                                                           if ops[passes[i]].stage == stage)], []).extend(
                                DPOp(UNSHARD, stage, u) for u in ids[len(early):]
                            )
                    end = _after_sends(ops, last[stage])
                    while end < len(ops) and type(ops[end]) is DPOp and ops[end][:2] == (REDUCE_GRAD, stage):
                        end += 1
                    insert_at.setdefault(end, []).extend(DPOp(RESHARD, stage, u) for u in ids)
            for index, gathers in in_pass.items():
                insert_at.setdefault(index, []).extend(gathers)
            for added in insert_at.values():  # frees first where a free and a gather meet
                added.sort(key=lambda op: op.kind == UNSHARD)
            ranks.append(spliced(ops, insert_at))
        return Program(program.schedule, tuple(ranks))

    add_sharding_pass.__name__ = add_sharding_pass.__qualname__ = "add_sharding"
    return add_sharding_pass


# live activations a pass adds (a backward frees its microbatch's: B most, W the rest)
_LIVE = {Kind.F: 1.0, Kind.B: -0.5, Kind.W: -0.5, Kind.BW: -1.0}


def regather_gaps(ops: tuple[Op, ...], passes: list[int], stage: int) -> list[tuple[int, int]]:
    """Where a zero3-regather `stage` is freed and gathered again on its rank: (the pass
    after which it is freed, the pass before which it is gathered again), as indices into
    `passes` (the positions of the rank's compute ops in `ops`).

    A gap is the run of other chunks' passes between two consecutive passes of the stage.
    Counting live activations in passes (a forward adds one, a backward frees one), the
    stage is freed over a gap only where they crest inside it, above their level at both
    ends: elsewhere the stage's own passes hold as much beside its parameters, so freeing
    would cost a gather and lower no peak (a 1F1B alternation between two chunks, one pass
    of the other between two of this one, never frees). It is gathered again once they
    are halfway down from the gap's last crest to the higher of the two ends: a compromise
    the lowering makes without costs, between holding the parameters beside activations
    near the crest (gathered earlier) and leaving the gather less compute to hide under
    (gathered later); the simulator prices the outcome."""
    mine = [k for k, at in enumerate(passes) if ops[at].stage == stage]
    out = []
    for a, b in zip(mine, mine[1:]):
        if b - a < 3:
            continue
        level, levels = 0.0, [0.0]
        for k in range(a + 1, b):
            op = ops[passes[k]]
            level += _LIVE[op.kind] if type(op) is Action else 1.0  # a recomputation rebuilds one
            levels.append(level)
        crest, ends = max(levels[1:-1]), max(levels[0], levels[-1])
        if crest > ends:
            top = max(i for i in range(1, len(levels) - 1) if levels[i] == crest)
            # levels[i] is after the gap's pass a + i: gather before the pass after the one
            # that brings them halfway down from the crest to the higher end
            down = next(i for i in range(top + 1, len(levels)) if levels[i] <= (crest + ends) / 2)
            out.append((a, a + down + 1))
    return out


def check_dp_ops(program: Program, policies: Iterable[ShardingPolicy] | None = None,
                 units: DPUnits | None = None) -> None:
    """Raise ScheduleError unless the DP ops are well placed: each on its stage's rank, for
    a unit the stage has (`units`; None: any, as read from a text form); at most one
    REDUCE_GRAD per stage and unit, after the stage's last weight-gradient pass; a stage's
    passes only once every unit is gathered when it has any UNSHARD (all of them when its
    policy is zero3); no UNSHARD left open at the end of the step."""
    schedule = program.schedule
    owner = schedule.placement.stage_to_rank
    policy = per_stage(policies, schedule.num_stages) if policies is not None else None
    if units is not None:
        units.check_stages(schedule.num_stages)
    # per stage, the units its ops name: (None,) for a whole stage
    named: dict[int, set[int | None]] = {}
    for rank, ops in enumerate(program.ranks):
        for pos, op in enumerate(ops):
            if type(op) is not DPOp:
                continue
            where = f"rank {rank}, op {pos} ({op})"
            if not 0 <= op.stage < schedule.num_stages or owner[op.stage] != rank:
                raise ScheduleError(f"{where}: stage {op.stage} is not on rank {rank}; move it to its stage's rank")
            if units is not None and op.unit not in unit_ids(units, op.stage):
                n = units.count(op.stage)
                raise ScheduleError(
                    f"{where}: stage {op.stage} has {n} unit(s), "
                    + ("so its ops name none" if n == 1 else f"0..{n - 1}") + "; name one of them"
                )
            named.setdefault(op.stage, set()).add(op.unit)
    for stage, ids in named.items():
        if None in ids and len(ids) > 1:
            raise ScheduleError(
                f"stage {stage}: its DP ops name units {sorted(u for u in ids if u is not None)} and the whole stage "
                "too; give every op of a stage a unit, or none"
            )
    for rank, ops in enumerate(program.ranks):
        gathered: set[tuple[int, int | None]] = set()
        reduced: set[tuple[int, int | None]] = set()
        ops = expanded(ops)  # an overlapped pair's parts, one by one
        sharded = {op.stage for op in ops if type(op) is DPOp and op.kind == UNSHARD}
        if policy is not None:
            sharded |= {s for s, p in enumerate(policy) if p.shards_parameters and owner[s] == rank}
        expected = {s: {(s, u) for u in (named.get(s) or unit_ids(units, s))} for s in sharded}
        for pos, op in enumerate(ops):
            where = f"rank {rank}, op {pos} ({op})"
            if type(op) is DPOp:
                key = (op.stage, op.unit)
                if op.kind == UNSHARD:
                    if key in gathered:
                        raise ScheduleError(f"{where}: {_name(key)} is already gathered; RESHARD it first")
                    gathered.add(key)
                elif op.kind == RESHARD:
                    if key not in gathered:
                        raise ScheduleError(f"{where}: {_name(key)} is not gathered; UNSHARD it first")
                    gathered.discard(key)
                else:
                    if key in reduced:
                        raise ScheduleError(f"{where}: {_name(key)} reduces its gradients twice in one step")
                    reduced.add(key)
            elif type(op) is Action or type(op) is Recompute:  # a recomputation runs the stage's forward
                if op.stage in sharded:
                    missing = sorted(expected[op.stage] - gathered, key=lambda k: -1 if k[1] is None else k[1])
                    if missing:
                        first = DPOp(UNSHARD, *missing[0])
                        raise ScheduleError(
                            f"{where}: {_name(missing[0])}'s parameters are sharded here; put {first} before it"
                        )
                if _is_weight_grad(op) and any(s == op.stage for s, _ in reduced):
                    done = next(DPOp(REDUCE_GRAD, s, u) for s, u in reduced if s == op.stage)
                    raise ScheduleError(
                        f"{where}: runs after {done}; reduce after the stage's last weight gradient"
                    )
        if gathered:
            raise ScheduleError(
                f"rank {rank}: {', '.join(_name(k) for k in sorted(gathered, key=_order))} still gathered at the end "
                "of the step; add a RESHARD"
            )


def _order(key: tuple[int, int | None]) -> tuple[int, int]:
    return (key[0], -1 if key[1] is None else key[1])


def _name(key: tuple[int, int | None]) -> str:
    stage, unit = key
    return f"stage {stage}" if unit is None else f"stage {stage} unit {unit}"
