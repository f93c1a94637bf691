"""The elastic schedule (PipeMesh, Li et al., IEEE TPDS 2025): how many microbatches go
through a chunk together is a sequence of group sizes, between depth-first and
breadth-first.

Forward groups (f1, f2, ...) and backward groups (b1, b2, ...) each sum to m. On the
looped placement with v chunks, the forward units of rank r run group by group, each
group through chunk 0, then chunk 1, ...; the backward units likewise from chunk v-1 down
to 0. Rank r warms up with (v-1)*f1 + 2(p-r-1) forward units (all of them for one group
of m > p), then runs one forward and one backward unit, bringing a forward early when the
next backward needs it on this rank. Groups of p everywhere give interleaved 1F1B's
order (depth-first, Megatron); one group of m gives bfs's order (breadth-first). Bigger
groups keep a chunk's parameters busy for longer, so its data-parallel gather and
reduction hide under more compute, at the price of more activations in flight.

Without explicit groups the sizes come from the costs: `rule_groups` (enough
microbatches together to hide each chunk's DP communication, no more than memory allows)
is the starting point, and `search_groups` simulates group sequences around it and keeps
the fastest that fits `gpu_memory`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from ..core.cost.costs import Costs
from ..core.ir.errors import ScheduleError
from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ..core.simulator.simulate import simulate
from ._build import BW, F, require
from .registry import register

__all__ = [
    "balanced", "elastic", "elastic_order", "group_candidates", "parse_groups", "rule_groups", "rule_sequences",
    "search_groups",
]


def parse_groups(value: object, p: int, m: int, name: str) -> tuple[int, ...]:
    """Group sizes from a sequence, an int, or text "8,4": each >= 1, all but the last
    >= min(p, m), summing to m."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, str):
        try:
            value = tuple(int(x) for x in value.replace(" ", "").split(",") if x)
        except ValueError:
            raise ScheduleError(f"{flag} {value!r}: expected whole numbers separated by commas, e.g. 8,4") from None
    elif isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not value or not all(
        isinstance(g, int) and not isinstance(g, bool) for g in value
    ):
        raise ScheduleError(f"{flag} {value!r}: expected a list of microbatch counts, e.g. 8,4")
    groups = tuple(value)
    bad = [g for g in groups if g < 1]
    if bad:
        raise ScheduleError(f"{flag} {','.join(map(str, groups))}: every group needs 1 or more microbatches, got {bad}")
    short = [g for g in groups[:-1] if g < min(p, m)]
    if short:
        raise ScheduleError(
            f"{flag} {','.join(map(str, groups))}: every group but the last needs at least min(p, m)={min(p, m)} "
            f"microbatches, got {short}: smaller groups starve the pipeline; merge them"
        )
    if sum(groups) != m:
        raise ScheduleError(
            f"{flag} {','.join(map(str, groups))} sums to {sum(groups)}, but a step has m={m} microbatches: "
            f"make the groups sum to {m}"
        )
    return groups


def balanced(m: int, count: int) -> tuple[int, ...]:
    """m split into `count` groups as even as possible, larger ones first."""
    count = max(1, min(count, m))
    q, rest = divmod(m, count)
    return tuple(q + 1 if i < rest else q for i in range(count))


def _ranges(groups: Sequence[int]) -> list[range]:
    out, start = [], 0
    for g in groups:
        out.append(range(start, start + g))
        start += g
    return out


def elastic_order(p: int, m: int, v: int, forward: Sequence[int], backward: Sequence[int]) -> tuple[tuple, ...]:
    """Per rank, the actions for these groups (already checked). A last group smaller than
    p is built as p with padding microbatches that are then dropped (as interleaved 1F1B
    does): a short last group can otherwise deadlock (p=4, m=5, v=3, groups 4,1)."""
    pad = max(0, min(p, m) - forward[-1]) if len(forward) > 1 else 0
    if pad:
        forward = (*forward[:-1], forward[-1] + pad)
        backward = (*backward[:-1], backward[-1] + pad)
        return tuple(tuple(a for a in actions if a.microbatch < m) for actions in _order(p, m + pad, v, forward, backward))
    return _order(p, m, v, forward, backward)


def _order(p: int, m: int, v: int, forward: Sequence[int], backward: Sequence[int]) -> tuple[tuple, ...]:
    fwd_units = [(c, i) for g in _ranges(forward) for c in range(v) for i in g]
    bwd_units = [(c, i) for g in _ranges(backward) for c in reversed(range(v)) for i in g]
    position = {unit: k for k, unit in enumerate(fwd_units)}
    total = len(fwd_units)
    ranks = []
    for r in range(p):
        warmup = total if forward[0] >= m > p else min(total, (v - 1) * forward[0] + 2 * (p - r - 1))
        actions, done = [F(c * p + r, i) for c, i in fwd_units[:warmup]], warmup
        for k, (c, i) in enumerate(bwd_units):
            # one forward per backward in the steady state, and every forward this
            # backward's microbatch needs on this rank (its last chunk) before it
            target = max(min(total, warmup + k + 1), position[(v - 1, i)] + 1)
            actions += [F(cf * p + r, j) for cf, j in fwd_units[done:target]]
            done = max(done, target)
            actions.append(BW(c * p + r, i))
        ranks.append(tuple(actions))
    return tuple(ranks)


def _schedule(p: int, m: int, v: int, forward: tuple[int, ...], backward: tuple[int, ...], how: str) -> Schedule:
    options = (("v", v), ("forward_groups", forward), ("backward_groups", backward), ("groups_from", how))
    return Schedule("elastic", p, m, Placement.loop(p, v), elastic_order(p, m, v, forward, backward), options=options)


def rule_groups(p: int, m: int, v: int, costs: Costs | None, gpu_memory: float | None = None) -> tuple[int, int, int]:
    """(G, G_comm, G_mem): G = min(max(p, G_comm), G_mem, m), never below min(p, m).

    G_comm = ceil(T_comm / T_comp) over the chunks: the microbatches whose compute (F + B
    + W of one microbatch on the chunk) hides the chunk's DP gather and reduction.
    G_mem = floor((gpu_memory - static memory at the step's peak) / one microbatch's
    activation over the rank's chunks), the worst rank; unbounded without gpu_memory.
    A G_mem below p is left to recomputation rather than starving the pipeline."""
    costs = costs or Costs()
    placement = Placement.loop(p, v)
    table = costs.resolve(placement)
    dp = table.data_parallel
    g_comm = 0
    if dp.dp > 1:
        policies = dp.policies(placement.num_stages)
        for s in range(placement.num_stages):
            comm = dp.op_time("REDUCE_GRAD", table.params[s], policies[s])
            if policies[s].shards_parameters:
                comm += dp.op_time("UNSHARD", table.params[s], policies[s])
            comp = table.f[s] + table.b[s] + table.w[s]
            if comp > 0:
                g_comm = max(g_comm, math.ceil(comm / comp))
    g_mem = m
    if gpu_memory is not None:
        for r in range(p):
            stages = placement.stages_of(r)
            free = gpu_memory - dp.static_memory(table.params, stages, peak=True)
            per_mb = sum(table.mem_b[s] for s in stages)
            if per_mb > 0:
                g_mem = min(g_mem, max(0, math.floor(free / per_mb)))
    g = min(max(p, g_comm), g_mem, m)
    return max(g, min(p, m)), g_comm, g_mem


def rule_sequences(m: int, g: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A first forward group of g, the rest in groups of g; backward balanced over as many groups."""
    forward = (g,) + tuple(min(g, m - start) for start in range(g, m, g))
    return forward, balanced(m, len(forward))


def group_candidates(
    p: int, m: int, start: tuple[tuple[int, ...], tuple[int, ...]],
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (forward, backward) sequences the searches try around `start` (the rule's):
    first forward group f1 and later groups g from {p, 2p, ..., m} (and the rule's sizes),
    backward balanced over 1 .. ceil(m/p) groups; `start` first, no repeats."""
    sizes = sorted({min(m, k * p) for k in range(1, -(-m // p) + 1)} | {start[0][0], m, min(p, m)})
    counts = sorted({len(start[1])} | set(range(1, -(-m // max(1, min(p, m))) + 1)))
    out = {start: None}
    for f1 in sizes:
        for g in sizes:
            forward = (f1,) + tuple(min(g, m - s) for s in range(f1, m, g))
            for count in counts:
                out.setdefault((forward, balanced(m, count)), None)
    return list(out)


def search_groups(
    p: int, m: int, v: int, costs: Costs, gpu_memory: float | None, start: tuple[tuple[int, ...], tuple[int, ...]],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The fastest simulated (forward, backward) groups that fit `gpu_memory`, among
    `group_candidates` around `start` (the rule). Score: (memory over the budget, step
    time); the start wins ties."""
    seen: dict[tuple, tuple] = {}

    def score(forward: tuple[int, ...], backward: tuple[int, ...]) -> tuple:
        key = (forward, backward)
        if key not in seen:
            timeline = simulate(_schedule(p, m, v, forward, backward, "search"), costs)
            need = max(timeline.memory_need)
            over = max(0.0, need - gpu_memory) if gpu_memory is not None else 0.0
            seen[key] = (over, timeline.makespan)
        return seen[key]

    best = start
    for forward, backward in group_candidates(p, m, start):
        if score(forward, backward) < score(*best):
            best = (forward, backward)
    return best


@register("elastic", "elastic groups (PipeMesh): microbatches through a chunk together, p (depth-first) to m (breadth-first)")
def elastic(
    *, p: int, m: int, v: int = 2, forward_groups: object = None, backward_groups: object = None,
    costs: Costs | None = None, gpu_memory: float | None = None, search: bool = True,
) -> Schedule:
    """Elastic schedule: microbatches go through each chunk in forward groups and come
    back in backward groups (each a sequence summing to m).

    Explicit groups: `forward_groups=8,4 backward_groups=6,6` (one given: the other is
    the same). Otherwise the rule G = min(max(p, G_comm), G_mem, m) from `costs` (and
    `gpu_memory`, in the costs' memory units) gives a first forward group of G, the rest
    in groups of G, and the backward balanced over as many groups; with `search` (the
    default, and when costs are given) the simulator then tries group sequences around
    it and keeps the fastest that fits. p=2, m=6, v=2, forward_groups=4,2, backward_groups=3,3::

        0: 0F0 0F1 0F2 0F3 2F0 2F1 2F2 2BW0 2F3 2BW1 0F4 2BW2 0F5 0BW0 2F4 0BW1 2F5 0BW2 2BW3 2BW4 2BW5 0BW3 0BW4 0BW5
        1: 1F0 1F1 1F2 1F3 3F0 3BW0 3F1 3BW1 3F2 3BW2 3F3 1BW0 1F4 1BW1 1F5 1BW2 3F4 3BW3 3F5 3BW4 3BW5 1BW3 1BW4 1BW5
    """
    require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"v must be an integer >= 1, got {v!r}")
    if forward_groups is None and backward_groups is None:
        g, _, _ = rule_groups(p, m, v, costs, gpu_memory)
        forward, backward = rule_sequences(m, g)
        how = "rule"
        if search and costs is not None:
            chosen = search_groups(p, m, v, costs, gpu_memory, (forward, backward))
            how = "rule" if chosen == (forward, backward) else "search"
            forward, backward = chosen
        return _schedule(p, m, v, forward, backward, how)
    forward = parse_groups(forward_groups if forward_groups is not None else backward_groups, p, m, "forward_groups")
    backward = parse_groups(backward_groups if backward_groups is not None else forward_groups, p, m, "backward_groups")
    return _schedule(p, m, v, forward, backward, "given")
