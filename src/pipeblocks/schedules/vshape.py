"""The V family with controllable memory, each defined as a building block.

V placement: rank i holds chunk 0 (stage i) and chunk 1 (stage 2p-1-i). In a block,
chunk-0 F and chunk-1 B travel down the ranks, chunk-1 F and chunk-0 B travel up; the
shifts between neighbouring ranks set the lifespans and so the memory (peak about
(down + up) / 6 of one microbatch's full-model activation at T = 6):

    v-min    shifts 1/1   peak ~ p/3     (1F1B: p)
    v-half   shifts 2/1   peak ~ p/2
    v-zb     shifts summing to 6, peak p, zero bubble at equal costs
    1f1b-v   fused backward (BW, two slots), peak ~ 2p/3

Given costs that are not uniform (unequal F/B/W times, communication time, per-stage
differences or M_W < M_B), v-min, v-half and v-zb are cost-aware by default:
at the pattern's peak they keep the fastest order under the costs (the pattern, the pattern
with its Ws placed again for the costs, a list schedule, local search; `_cost_aware`);
`cost_aware=False` keeps the pattern.

Usage::

    from pipeblocks.schedules import get
    s = get("v-half")(p=8, m=24)
"""
from __future__ import annotations

from ..core.ir.actions import Action, Kind
from ..core.cost.costs import Costs
from ..core.ir.errors import ScheduleError, check_counts
from ..core.ir.placement import Placement
from ..core.ir.schedule import Schedule
from ._cost_aware import cost_aware_v, wants_cost_aware
from ._reorder import cost_table, peaks_of
from ._zbv_reference import reference_v_candidates
from .blocks import Block, BlockPass, build, build_orders, fit_block
from .registry import register

__all__ = [
    "v_block", "v_block_from_offsets", "v_block_variants", "two_part_block", "v_fused_block", "v_min", "v_half", "v_zb", "one_f_one_b_v",
]

T = 6  # two chunks x (F, B, W), one slot each


def v_block(p: int, shifts: tuple[int, int, int, int]) -> Block:
    """The V block with constant shifts between neighbouring ranks, given as
    (F0, F1, B1, B0); chunk-0 F and chunk-1 B travel down, the others up. The F0 and B1
    shifts must be equal, and so must the F1 and B0 shifts (the V's two directions).
    """
    s_f0, s_f1, s_b1, s_b0 = shifts
    if s_f0 != s_b1 or s_f1 != s_b0 or min(shifts) < 1:
        raise ScheduleError(f"V shifts {shifts}: give (d, u, d, u) with d, u >= 1")
    return v_block_from_offsets(p, [s_f0 * i for i in range(p)], [s_f1 * (p - 1 - i) for i in range(p)])


def v_block_from_offsets(p: int, down: list[int], up: list[int]) -> Block:
    """A V block from per-rank offsets; see `v_block_variants` (this is its first)."""
    return v_block_variants(p, down, up)[0]


def v_block_variants(p: int, down: list[int], up: list[int]) -> list[Block]:
    """A V block from per-rank offsets: rank i starts F0 at down[i] and B1 at
    down[i] + c, F1 at a + up[i] and B0 at b + up[i] (down[0] = up[p-1] = 0).

    The three turn gaps (bottom F turn, top F1->B1, bottom B turn) fixing a, b and c
    range over 1..6 and must keep F and B collision-free mod 6; the Ws then go into
    each rank's free residues, earliest after their B. Returns one block per distinct
    set of lifespans, the smallest lifespan bound (then gap sum) first. Longer turn gaps
    matter: they shift where each rank's memory peaks, and at an odd number of chunk
    activations the best schedule often comes from one (p=4, k=5: gaps 1/1/3 idle 9
    slots, the tightest gaps 10).
    """
    if p < 1:
        raise ScheduleError(f"p must be an integer >= 1, got {p!r}")
    placement = Placement.v_shape(p)
    found: dict[tuple[int, ...], tuple[tuple[float, int], Block]] = {}
    r_f0 = [d % T for d in down]
    for g1 in range(1, T + 1):
        a = down[-1] + g1
        r_f1 = [(a + u) % T for u in up]
        if any(x == y for x, y in zip(r_f0, r_f1)):
            continue
        for g2 in range(1, T + 1):
            c = a + up[0] + g2
            r_b1 = [(c + d) % T for d in down]
            if any(z in (x, y) for x, y, z in zip(r_f0, r_f1, r_b1)):
                continue
            for g3 in range(1, T + 1):
                b = c + down[-1] + g3
                r_b0 = [(b + u) % T for u in up]
                if any(w in (x, y, z) for x, y, z, w in zip(r_f0, r_f1, r_b1, r_b0)):
                    continue
                fb = []
                for i in range(p):
                    fb += [
                        BlockPass(i, Kind.F, down[i]), BlockPass(2 * p - 1 - i, Kind.F, a + up[i]),
                        BlockPass(2 * p - 1 - i, Kind.B, c + down[i]), BlockPass(i, Kind.B, b + up[i]),
                    ]
                w_chain = [(bp.stage, Kind.W, 1) for bp in sorted(fb, key=lambda x: x.start) if bp.kind is Kind.B]
                try:
                    block = fit_block(placement, fb, w_chain, interval=T)
                except ScheduleError:
                    continue
                key = (max(block.lifespan_bound()), g1 + g2 + g3)
                if block.lifespans not in found or key < found[block.lifespans][0]:
                    found[block.lifespans] = (key, block)
    if not found:
        raise ScheduleError(f"no V block with these offsets tiles for p={p}: F and B collide mod {T}; choose other shifts")
    return [block for _, block in sorted(found.values(), key=lambda x: x[0])]


def two_part_block(p: int, split: int, first: int, rest: int) -> Block | None:
    """A V block with downward shift `first` between ranks 0..split and `rest` below,
    upward shifts 1; None if it does not tile."""
    down = [0]
    for i in range(1, p):
        down.append(down[-1] + (first if i <= split else rest))
    try:
        return v_block_from_offsets(p, down, [p - 1 - i for i in range(p)])
    except ScheduleError:
        return None


def v_fused_block(p: int) -> Block:
    """1F1B-V's block: F shifts 1, fused BW (two slots) placed earliest without collisions."""
    placement = Placement.v_shape(p)
    chain = [(i, Kind.F, 1) for i in range(p)] + [(2 * p - 1 - i, Kind.F, 1) for i in reversed(range(p))]
    chain += [(2 * p - 1 - i, Kind.BW, 2) for i in range(p)] + [(i, Kind.BW, 2) for i in reversed(range(p))]
    return fit_block(placement, (), chain, interval=T)


@register("v-min", "V shape, shifts 1/1: about 1/3 of 1F1B's activation memory", v=2)
def v_min(*, p: int, m: int, costs: Costs | None = None, cost_aware: bool | None = None, search: int = 100) -> Schedule:
    """V-Min: the V block with every shift 1, so each rank holds about 2p/3 chunk
    activations (p/3 in full-stage units, 1F1B holds p); bubble about 4p unit slots.
    When p = 2 mod 3 (p >= 5) the peak rounds up to (p+4)//3 and the last two downward
    shifts become 3, which keeps that peak and meets the bound 6p-1-3k for it (unit
    costs; under other costs the faster of the two blocks is kept).

    p=4, m=8::

        0: 0F0 0F1 7F0 7B0 7W0 0F2 7F1 7B1 0B0 7W1 0W0 0F3 7F2 7B2 0B1 7W2 0W1 0F4 7F3 7B3 0B2 7W3 0W2 0F5 7F4 7B4 0B3 7W4 0W3 0F6 7F5 7B5 0B4 7W5 0W4 0F7 7F6 7B6 0B5 7W6 0W5 7F7 7B7 0B6 7W7 0W6 0B7 0W7
        1: 1F0 6F0 1F1 6B0 6W0 6F1 1F2 1B0 6B1 6W1 1W0 6F2 1F3 1B1 6B2 6W2 1W1 6F3 1F4 1B2 6B3 6W3 1W2 6F4 1F5 1B3 6B4 6W4 1W3 6F5 1F6 1B4 6B5 6W5 1W4 6F6 1F7 1B5 6B6 6W6 1W5 6F7 1B6 6B7 6W7 1W6 1B7 1W7
        2: 2F0 5F0 2F1 5B0 5F1 5W0 2B0 2F2 2W0 5B1 5F2 5W1 2B1 2F3 2W1 5B2 5F3 5W2 2B2 2F4 2W2 5B3 5F4 5W3 2B3 2F5 2W3 5B4 5F5 5W4 2B4 2F6 2W4 5B5 5F6 5W5 2B5 2F7 2W5 5B6 5F7 5W6 2B6 2W6 5B7 5W7 2B7 2W7
        3: 3F0 4F0 3F1 4F1 4B0 3B0 4W0 3W0 3F2 4F2 4B1 3B1 4W1 3W1 3F3 4F3 4B2 3B2 4W2 3W2 3F4 4F4 4B3 3B3 4W3 3W3 3F5 4F5 4B4 3B4 4W4 3W4 3F6 4F6 4B5 3B5 4W5 3W5 3F7 4F7 4B6 3B6 4W6 3W6 4B7 3B7 4W7 3W7
    """
    check_counts(p=p, m=m)
    if wants_cost_aware("v-min", cost_aware, costs):
        return cost_aware_v(
            "v-min", p, m, _v_min_orders(p, m, None), costs, search=search,
            extra=[("pattern built for the costs", _v_min_orders(p, m, costs))],
        )
    return Schedule("v-min", p, m, Placement.v_shape(p), _v_min_orders(p, m, costs))


def _v_min_orders(p: int, m: int, costs: Costs | None) -> tuple[tuple[Action, ...], ...]:
    uniform = v_block(p, (1, 1, 1, 1))
    orders, times, peaks = build_orders(uniform, m, costs=costs)
    if p % 3 == 2 and p >= 5:
        # Here the uniform block holds (p+4)//3 stage activations, a third more than p/3,
        # yet idles 3 slots above the bound 6p-1-3k for that memory (p=8: 26 vs 23). The
        # last two hops at downward shift 3 keep the same peak and reach the bound.
        block = two_part_block(p, p - 3, 1, 3)
        try:
            alt = build_orders(block, m, costs=costs, memory_cap=max(peaks)) if block is not None else None
        except ScheduleError:  # no order of it fits the uniform peak under these costs
            alt = None
        if alt is not None and alt[1] < times:
            orders = alt[0]
    return orders


@register("v-half", "V shape, shifts 2/1: about 1/2 of 1F1B's activation memory", v=2)
def v_half(*, p: int, m: int, costs: Costs | None = None, cost_aware: bool | None = None, search: int = 100) -> Schedule:
    """V-Half: the V block with downward shifts 2 and upward shifts 1; each rank holds
    about p chunk activations (p/2 in full-stage units); bubble about 3p unit slots.

    p=4, m=8::

        0: 0F0 0F1 0F2 0F3 0F4 7F0 7B0 7W0 7F1 7B1 7W1 7F2 7B2 7W2 0B0 0W0 0F5 7F3 7B3 7W3 0B1 0W1 0F6 7F4 7B4 7W4 0B2 0W2 0F7 7F5 7B5 7W5 0B3 0W3 7F6 7B6 7W6 0B4 0W4 7F7 7B7 0B5 7W7 0B6 0W5 0W6 0B7 0W7
        1: 1F0 1F1 1F2 1F3 6F0 6F1 6B0 6W0 6F2 6B1 6W1 1F4 1B0 1W0 6B2 6F3 6W2 1F5 1B1 1W1 6B3 6F4 6W3 1F6 1B2 1W2 6B4 6F5 6W4 1F7 1B3 1W3 6B5 6F6 6W5 1B4 1W4 6B6 6F7 6W6 1B5 6B7 1B6 1W5 6W7 1W6 1B7 1W7
        2: 2F0 2F1 2F2 5F0 5F1 5F2 5B0 5W0 2F3 5B1 2B0 5W1 2W0 5F3 2F4 5B2 2B1 5W2 2W1 5F4 2F5 5B3 2B2 5W3 2W2 5F5 2F6 5B4 2B3 5W4 2W3 5F6 2F7 5B5 2B4 5W5 2W4 5F7 5B6 2B5 5W6 2B6 5B7 2W5 2W6 2B7 5W7 2W7
        3: 3F0 4F0 3F1 4F1 3F2 4F2 4B0 4W0 3B0 3W0 3F3 4F3 4B1 4W1 3B1 3W1 3F4 4F4 4B2 4W2 3B2 3W2 3F5 4F5 4B3 4W3 3B3 3W3 3F6 4F6 4B4 4W4 3B4 3W4 3F7 4F7 4B5 3B5 4B6 3B6 4W5 3W5 4B7 3B7 4W6 3W6 4W7 3W7
    """
    check_counts(p=p, m=m)
    block = v_block(p, (2, 1, 2, 1))
    if wants_cost_aware("v-half", cost_aware, costs):
        return cost_aware_v(
            "v-half", p, m, build_orders(block, m)[0], costs, search=search,
            extra=[("pattern built for the costs", build_orders(block, m, costs=costs)[0])],
        )
    return build(block, m, name="v-half", costs=costs)


@register("v-zb", "V shape at 1F1B's memory (p): zero bubble at equal F/B/W costs", v=2)
def v_zb(*, p: int, m: int, costs: Costs | None = None, cost_aware: bool | None = None, search: int = 100) -> Schedule:
    """V-ZB: the V block with downward shifts 4 and upward shifts 2 (their sum 6 is the
    interval), so each rank's lifespans total about 12p slots and the peak is 1F1B's:
    2p chunk activations, p in full-stage units. At equal F/B/W costs no rank idles
    between its first and last pass; the last rank starts p-1 slots late.

    p=4, m=8::

        0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7B0 7W0 7F1 7B1 7W1 7F2 7B2 7W2 7F3 7B3 0B0 7W3 0W0 0F7 7F4 7B4 0B1 7W4 0W1 7F5 7B5 0B2 7W5 0W2 7F6 7B6 0B3 7W6 0W3 7F7 7B7 0B4 7W7 0B5 0W4 0B6 0W5 0B7 0W6 0W7
        1: 1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6B0 6W0 6F2 6B1 6W1 6F3 6B2 1B0 6W2 1W0 1F6 6F4 6B3 1B1 6W3 1W1 1F7 6F5 6B4 1B2 6W4 1W2 6F6 6B5 1B3 6W5 1W3 6F7 6B6 1B4 6B7 1B5 6W6 1B6 1W4 1B7 6W7 1W5 1W6 1W7
        2: 2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5B0 5W0 5F3 5B1 2B0 5W1 2W0 2F5 5F4 5B2 2B1 5W2 2W1 2F6 5F5 5B3 2B2 5W3 2W2 2F7 5F6 5B4 2B3 5W4 2W3 5F7 5B5 2B4 5B6 2B5 5B7 2B6 5W5 2B7 2W4 5W6 2W5 5W7 2W6 2W7
        3: 3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4B0 3B0 4W0 3W0 3F4 4F4 4B1 3B1 4W1 3W1 3F5 4F5 4B2 3B2 4W2 3W2 3F6 4F6 4B3 3B3 4W3 3W3 3F7 4F7 4B4 3B4 4B5 3B5 4B6 3B6 4B7 3B7 4W4 3W4 4W5 3W5 4W6 3W6 4W7 3W7
    """
    check_counts(p=p, m=m)
    block = v_block(p, (4, 2, 4, 2))
    if wants_cost_aware("v-zb", cost_aware, costs):
        pattern = build_orders(block, m)[0]
        table = cost_table(Placement.v_shape(p), costs)
        limit = max(peaks_of(pattern, table))
        return cost_aware_v(
            "v-zb", p, m, pattern, costs, search=search, reference=reference_v_candidates(p, m, table, limit),
            extra=[("pattern built for the costs", build_orders(block, m, costs=costs)[0])],
        )
    return build(block, m, name="v-zb", costs=costs)


@register("1f1b-v", "V placement without B/W split (fused BW): about 2/3 of 1F1B's memory", v=2)
def one_f_one_b_v(*, p: int, m: int, costs: object | None = None) -> Schedule:
    """1F1B-V: V placement with the fused backward; F shifts 1, each BW (two slots) at the
    earliest collision-free slot. Peak about 2/3 of 1F1B's: rank 0's chunk-0 lifespan is
    about 8p slots (F chain 2p, BW chain 4p, and mod-6 collisions force a 3-slot gap every
    third BW hop), so it holds ceil(l/6) + 1 chunk activations, 2p/3 + about 1/2 stage
    activations: 0.75 of 1F1B at p=4 and 8, 0.69 at p=16. The fully packed period (F0,
    F1, two BW slots each, T = 6) leaves no free residue to shorten it.

    p=4, m=8::

        0: 0F0 0F1 0F2 0F3 0F4 7F0 7BW0 7F1 7BW1 7F2 7BW2 7F3 7BW3 0BW0 0F5 7F4 7BW4 0BW1 0F6 7F5 7BW5 0BW2 0F7 7F6 7BW6 0BW3 7F7 7BW7 0BW4 0BW5 0BW6 0BW7
        1: 1F0 1F1 1F2 1F3 6F0 6F1 6BW0 6F2 6BW1 1F4 6BW2 6F3 1BW0 6BW3 6F4 1F5 1BW1 6BW4 6F5 1F6 1BW2 6BW5 6F6 1F7 1BW3 6BW6 6F7 1BW4 6BW7 1BW5 1BW6 1BW7
        2: 2F0 2F1 2F2 5F0 5F1 5F2 5BW0 2F3 5BW1 2F4 2BW0 5F3 5BW2 2BW1 5F4 5BW3 2F5 2BW2 5F5 5BW4 2F6 2BW3 5F6 5BW5 2F7 2BW4 5F7 5BW6 2BW5 5BW7 2BW6 2BW7
        3: 3F0 4F0 3F1 4F1 3F2 4F2 4BW0 3BW0 3F3 4F3 4BW1 3BW1 3F4 4F4 4BW2 3BW2 3F5 4F5 4BW3 3BW3 3F6 4F6 4BW4 3BW4 3F7 4F7 4BW5 3BW5 4BW6 3BW6 4BW7 3BW7
    """
    check_counts(p=p, m=m)
    return build(v_fused_block(p), m, name="1f1b-v", costs=costs)
