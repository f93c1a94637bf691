"""Elastic groups and per-chunk sharding chosen together (`elastic --sharding auto`), and
groups chosen with recomputation in view (`elastic --recompute auto`).

Which chunks can shard their parameters depends on the groups (a gather hides only under
the compute of the group before it), and which groups fit depends on the sharding (its
static memory at the step's peak). The search therefore alternates on the simulator:
groups for the current sharding (`elastic.search_groups`'s candidates), then a sharding
for those groups (coordinate descent over the chunks, as `auto_sharding`), until neither
changes (the sharding moves: one chunk index on every rank at once, then one stage). It
starts from both one-sided answers, the groups searched under the uniform
policy and the sharding chosen for the rule's groups, and keeps the best plan it
simulated, so it is never slower than either by more than `tolerance` (and then lighter).
With v > 1 a third start is the groups searched with the uniform policy's zero3 chunks
as zero3-regather (freed between visits): larger groups that fit only so are otherwise
out of reach of moves that change the groups or one policy at a time.

With `--recompute auto` every candidate is scored after `choose_recompute` has made it fit
(a plan that needs recomputation pays for it in its simulated step time), so the search
trades larger groups against recomputation instead of ruling out everything that does not
fit without it. A candidate is scored by (memory over the budget, step time, chunks that
regather, memory need of the fullest rank, then of all ranks together): step times within
`tolerance` (relative) count as equal, so the lighter plan wins, but `zero3-regather` (a
chunk freed between its visits and gathered again) only where it fits a budget nothing
else fits, or saves time (less recomputation), as `auto_sharding` decides.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.cost.costs import Costs
from ..core.ir.errors import ScheduleError
from ..core.lowering.recompute import all_pairs
from ..core.ir.schedule import Schedule
from ..core.ir.sharding import ShardingPolicy
from .program import simulate_run
from ..schedules.elastic import elastic, group_candidates, rule_groups, rule_sequences
from .auto_sharding import Policies, descend_policies, regathering
from .recompute_auto import choose_recompute, memory_need

__all__ = ["ElasticPlan", "choose_elastic_plan"]

Groups = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class ElasticPlan:
    """The chosen schedule, its per-chunk policies, the pairs to recompute, and what the
    search did: `simulated` candidates, and the one-sided answers' step times
    (`groups_only`: groups searched under `start` sharding; `sharding_only`: sharding
    chosen for the rule's groups) beside the plan's own."""

    schedule: Schedule
    sharding: Policies
    recompute: frozenset[tuple[int, int]]
    makespan: float
    groups_only: float
    sharding_only: float
    simulated: int


def choose_elastic_plan(
    p: int, m: int, v: int, costs: Costs, *, budget: float | None, recompute: bool, start: Policies,
    unit: float = 1.0, rounds: int = 3, tolerance: float = 1e-3, search_sharding: bool = True,
) -> ElasticPlan:
    """Groups and one policy per chunk for `elastic` under `costs` (whose data-parallel side
    gives d and the link), within `budget` per rank (the costs' memory units); with
    `recompute`, pairs chosen by `choose_recompute` for each candidate. `start`: the
    policy (one, or one per chunk) the groups-only answer uses; without `search_sharding`
    it is kept and only the groups are searched (`groups_from` "search")."""
    start = start * (p * v) if len(start) == 1 else tuple(start)
    search = _Search(p, m, v, costs, budget, recompute, unit, tolerance)
    g, _, _ = rule_groups(p, m, v, costs.with_sharding(start), budget)
    rule = rule_sequences(m, g)
    groups_only = (search.best_groups(start, rule), start)
    sharding_only = (rule, search.best_sharding(rule, start) if search_sharding else start)
    plans = [groups_only, sharding_only]
    if search_sharding:
        # a third start (see the module docstring): the groups searched with start's zero3 chunks freed between visits
        released = tuple(ShardingPolicy.ZERO3_REGATHER if ShardingPolicy(x) is ShardingPolicy.ZERO3 else x
                         for x in start)
        third = [(search.best_groups(released, rule), released)] if v > 1 and released != start else []
        plans += [search.refined(plan, rounds) for plan in plans + third]
    chosen = plans[0]
    for plan in plans[1:]:
        if search.better(plan, chosen):
            chosen = plan
    over, makespan, (need, _), pairs = search.evaluate(*chosen)
    if over > 0:
        how = " with --sharding auto" if search_sharding else ""
        raise ScheduleError(
            f"--gpu-memory {budget / unit:.4g} is too small for 'elastic'{how}: the least any plan found needs is "
            f"{need / unit:.4g} per rank (static memory at the step's peak + activation"
            f"{', with full recomputation' if recompute else ''}): raise --gpu-memory to at least {need / unit:.4g}"
            f"{'' if recompute else ', add --recompute auto'}, add replicas with sharding (--dp, --sharding zero3) "
            "or use more pipeline ranks"
        )
    (forward, backward), policies = chosen
    schedule = elastic(p=p, m=m, v=v, forward_groups=forward, backward_groups=backward)
    schedule = dataclasses.replace(
        schedule, options=tuple(
            (k, ("joint" if search_sharding else "search") if k == "groups_from" else val) for k, val in schedule.options
        ),
    )
    return ElasticPlan(
        schedule, policies, pairs, makespan, search.evaluate(*groups_only)[1], search.evaluate(*sharding_only)[1],
        len(search.seen),
    )


class _Search:
    """Candidates (groups, policies) scored once each: memory over the budget, step time,
    then the fewest regathering chunks, then memory."""

    def __init__(self, p: int, m: int, v: int, costs: Costs, budget: float | None, recompute: bool, unit: float,
                 tolerance: float) -> None:
        self.p, self.m, self.v, self.costs, self.budget = p, m, v, costs, budget
        self.recompute, self.unit, self.tolerance = recompute, unit, tolerance
        self.seen: dict[tuple[Groups, Policies], tuple] = {}
        # sharding moves: one chunk index on every rank at once (stages c*p .. c*p+p-1: the
        # step's critical path crosses every rank, so one rank's change alone rarely shows),
        # then one stage at a time
        self.moves = [range(c * p, (c + 1) * p) for c in range(v)] + [range(s, s + 1) for s in range(p * v)]

    def evaluate(self, groups: Groups, policies: Policies) -> tuple:
        key = (groups, policies)
        if key not in self.seen:
            trial = self.costs.with_sharding(policies)
            schedule = elastic(p=self.p, m=self.m, v=self.v, forward_groups=groups[0], backward_groups=groups[1])
            pairs: frozenset = frozenset()
            if self.recompute and self.budget is not None:
                try:
                    pairs = choose_recompute(schedule, trial, self.budget, unit=self.unit, minimal=False)
                except ScheduleError:
                    pairs = all_pairs(schedule)  # does not fit even so: scored by how far over
            timeline = simulate_run(schedule, trial, recompute=pairs)
            needs = memory_need(timeline)
            need = max(needs)
            over = max(0.0, need - self.budget) if self.budget is not None else 0.0
            self.seen[key] = (over, timeline.makespan, (need, sum(needs)), pairs)
        return self.seen[key]

    def better(self, a: tuple[Groups, Policies], b: tuple[Groups, Policies]) -> bool:
        over_a, time_a, need_a, _ = self.evaluate(*a)
        over_b, time_b, need_b, _ = self.evaluate(*b)
        if over_a != over_b:
            return over_a < over_b
        if abs(time_a - time_b) > self.tolerance * min(time_a, time_b):
            return time_a < time_b
        if regathering(a[1]) != regathering(b[1]):
            return regathering(a[1]) < regathering(b[1])
        return need_a < need_b

    def best_groups(self, policies: Policies, first: Groups) -> Groups:
        best = first
        for groups in group_candidates(self.p, self.m, first):
            if self.better((groups, policies), (best, policies)):
                best = groups
        return best

    def best_sharding(self, groups: Groups, first: Policies) -> Policies:
        # v > 1 keeps several chunks on every rank: each may regather (v = 1: none can)
        regather = None if self.v > 1 else frozenset()
        return descend_policies(lambda a, b: self.better((groups, a), (groups, b)), first, self.moves,
                                regather=regather)

    def refined(self, plan: tuple[Groups, Policies], rounds: int) -> tuple[Groups, Policies]:
        """`plan` with its sharding and its groups improved in turn, until the groups stay."""
        groups, policies = plan
        for _ in range(rounds):
            policies = self.best_sharding(groups, policies)
            new_groups = self.best_groups(policies, groups)
            if new_groups == groups:
                break
            groups = new_groups
        return groups, policies
