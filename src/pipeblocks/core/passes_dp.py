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

`dp_passes(policies, dp)` is the list `lowering.lower_for` appends to `lower.PASSES`:
nothing for a single replicated pipeline, otherwise the passes the policies need. Both
passes work on any Program (before or after `add_p2p`); DP ops never block on a pipeline
peer, so the deadlock check passes over them, and `check_dp_ops` proves their placement.
"""
from __future__ import annotations

from collections.abc import Iterable

from .actions import Action, Kind
from .errors import ScheduleError
from .program import Comm, DPOp, Op, Program, Recompute
from .sharding import ShardingPolicy, per_stage

__all__ = ["add_grad_reduce", "add_grad_reduce_at_end", "add_sharding", "check_dp_ops", "dp_passes", "dp_passes_at_end", "needs_dp_ops"]

UNSHARD, RESHARD, REDUCE_GRAD = "UNSHARD", "RESHARD", "REDUCE_GRAD"


def needs_dp_ops(policies: Iterable[ShardingPolicy], dp: int) -> bool:
    """Whether a Program for this mesh holds DP ops: more than one replica, or a policy
    other than replicate (a sharded runtime wants its ops even on one replica)."""
    return dp > 1 or any(ShardingPolicy(p) is not ShardingPolicy.REPLICATE for p in policies)


def dp_passes(policies: Iterable[ShardingPolicy], dp: int) -> tuple:
    """The DP lowering passes for `policies` (one, or one per stage) on `dp` replicas."""
    policies = tuple(ShardingPolicy(p) for p in policies)
    if not needs_dp_ops(policies, dp):
        return ()
    passes: list = []
    if any(p.shards_parameters for p in policies):
        passes.append(add_sharding(policies))
    passes.append(add_grad_reduce)
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


def add_grad_reduce(program: Program) -> Program:
    """Insert `sREDUCE_GRAD` after each stage's last weight-gradient pass on its rank."""
    ranks: list[tuple[Op, ...]] = []
    for ops in program.ranks:
        last: dict[int, int] = {}
        for i, op in enumerate(ops):
            if _is_weight_grad(op):
                last[op.stage] = i
        insert_at: dict[int, list[Op]] = {}
        for stage, i in last.items():
            insert_at.setdefault(_after_sends(ops, i), []).append(DPOp(REDUCE_GRAD, stage))
        ranks.append(_splice(ops, insert_at))
    return Program(program.schedule, tuple(ranks))


def add_grad_reduce_at_end(program: Program) -> Program:
    """Insert every stage's `sREDUCE_GRAD` at the end of its rank's ops (no overlap)."""
    ranks = []
    for ops in program.ranks:
        stages = sorted({op.stage for op in ops if _is_weight_grad(op)})
        ranks.append((*ops, *(DPOp(REDUCE_GRAD, s) for s in stages)))
    return Program(program.schedule, tuple(ranks))


def dp_passes_at_end(policies: Iterable[ShardingPolicy], dp: int) -> tuple:
    """As `dp_passes`, with the reductions at the end of the step (the no-overlap baseline)."""
    return tuple(add_grad_reduce_at_end if p is add_grad_reduce else p for p in dp_passes(policies, dp))


def add_sharding(policies: Iterable[ShardingPolicy]):
    """The pass that gathers each ZeRO-3 stage before its first pass and frees it after
    its last (after its REDUCE_GRAD when that is already placed)."""
    given = tuple(ShardingPolicy(p) for p in policies)

    def add_sharding_pass(program: Program) -> Program:
        policy = per_stage(given, program.schedule.num_stages)
        ranks: list[tuple[Op, ...]] = []
        for ops in program.ranks:
            first: dict[int, int] = {}
            last: dict[int, int] = {}
            group_start: list[int] = []  # per compute action: where its leading receives begin
            previous_group: dict[int, int] = {}
            own_group: dict[int, int] = {}  # where the receives before the stage's first pass begin
            start = 0
            for i, op in enumerate(ops):
                if type(op) is Action:
                    if op.stage not in first:
                        first[op.stage] = i
                        previous_group[op.stage] = group_start[-1] if group_start else 0
                        own_group[op.stage] = start
                    last[op.stage] = i
                    group_start.append(start)
                    start = i + 1
                elif not (type(op) is Comm and not op.send):
                    start = i + 1
            insert_at: dict[int, list[Op]] = {}
            order = sorted(first, key=first.__getitem__)
            for k, stage in enumerate(order):
                if policy[stage].shards_parameters:
                    # one stage ahead: where the rank starts on the stage before this one
                    # in first-use order (the step's start for the first two)
                    ahead = own_group[order[k - 1]] if k >= 2 else 0
                    insert_at.setdefault(min(ahead, previous_group[stage]), []).append(DPOp(UNSHARD, stage))
                    end = _after_sends(ops, last[stage])
                    while end < len(ops) and ops[end] == DPOp(REDUCE_GRAD, stage):
                        end += 1
                    insert_at.setdefault(end, []).append(DPOp(RESHARD, stage))
            ranks.append(_splice(ops, insert_at))
        return Program(program.schedule, tuple(ranks))

    add_sharding_pass.__name__ = add_sharding_pass.__qualname__ = "add_sharding"
    return add_sharding_pass


def _splice(ops: tuple[Op, ...], insert_at: dict[int, list[Op]]) -> tuple[Op, ...]:
    if not insert_at:
        return ops
    out: list[Op] = []
    for i, op in enumerate(ops):
        out.extend(insert_at.get(i, ()))
        out.append(op)
    out.extend(insert_at.get(len(ops), ()))
    return tuple(out)


def check_dp_ops(program: Program, policies: Iterable[ShardingPolicy] | None = None) -> None:
    """Raise ScheduleError unless the DP ops are well placed: each on its stage's rank; at
    most one REDUCE_GRAD per stage, after its last weight-gradient pass; a stage's passes
    only between an UNSHARD and the next RESHARD when it has any (all of them when its
    policy is zero3); no UNSHARD left open at the end of the step."""
    schedule = program.schedule
    owner = schedule.placement.stage_to_rank
    policy = per_stage(policies, schedule.num_stages) if policies is not None else None
    for rank, ops in enumerate(program.ranks):
        gathered: set[int] = set()
        reduced: set[int] = set()
        sharded = {op.stage for op in ops if type(op) is DPOp and op.kind == UNSHARD}
        if policy is not None:
            sharded |= {s for s, p in enumerate(policy) if p.shards_parameters and owner[s] == rank}
        for pos, op in enumerate(ops):
            where = f"rank {rank}, op {pos} ({op})"
            if type(op) is DPOp:
                if not 0 <= op.stage < schedule.num_stages or owner[op.stage] != rank:
                    raise ScheduleError(f"{where}: stage {op.stage} is not on rank {rank}; move it to its stage's rank")
                if op.kind == UNSHARD:
                    if op.stage in gathered:
                        raise ScheduleError(f"{where}: stage {op.stage} is already gathered; RESHARD it first")
                    gathered.add(op.stage)
                elif op.kind == RESHARD:
                    if op.stage not in gathered:
                        raise ScheduleError(f"{where}: stage {op.stage} is not gathered; UNSHARD it first")
                    gathered.discard(op.stage)
                else:
                    if op.stage in reduced:
                        raise ScheduleError(f"{where}: stage {op.stage} reduces its gradients twice in one step")
                    reduced.add(op.stage)
            elif type(op) is Action or type(op) is Recompute:  # a recomputation runs the stage's forward
                if op.stage in sharded and op.stage not in gathered:
                    raise ScheduleError(
                        f"{where}: stage {op.stage}'s parameters are sharded here; put {op.stage}UNSHARD before it"
                    )
                if _is_weight_grad(op) and op.stage in reduced:
                    raise ScheduleError(
                        f"{where}: runs after {op.stage}REDUCE_GRAD; reduce after the stage's last weight gradient"
                    )
        if gathered:
            raise ScheduleError(
                f"rank {rank}: stage(s) {sorted(gathered)} still gathered at the end of the step; add a RESHARD"
            )
