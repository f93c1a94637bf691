"""The V family with controllable memory, each defined as a building block.

V placement: rank i holds chunk 0 (stage i) and chunk 1 (stage 2p-1-i). In a block,
chunk-0 F and chunk-1 B travel down the ranks, chunk-1 F and chunk-0 B travel up; the
shifts between neighbouring ranks set the lifespans and so the memory (peak about
(down + up) / 6 of one microbatch's full-model activation at T = 6):

    v-min    shifts 1/1   peak ~ p/3     (1F1B: p)
    v-half   shifts 2/1   peak ~ p/2
    v-zb     shifts summing to 6, peak p, zero bubble at equal costs
    1f1b-v   fused backward (BW, two slots), peak ~ 2p/3

Usage::

    from pipeblocks.schedules import get
    s = get("v-half")(p=8, m=24)
"""
from __future__ import annotations

from itertools import product

from ..core.actions import Kind
from ..core.errors import ScheduleError
from ..core.placement import Placement
from ..core.schedule import Schedule
from ._reorder import CostTable
from .blocks import Block, BlockPass, build, build_orders, fit_block
from .registry import register

__all__ = ["v_block", "v_fused_block", "v_min", "v_half", "v_zb", "one_f_one_b_v"]

T = 6  # two chunks x (F, B, W), one slot each


def _uniform_fb(p: int, shifts: tuple[int, int, int, int], gaps: tuple[int, int, int]) -> list[BlockPass]:
    """F0, F1, B1, B0 starts with constant shifts between ranks and the given turn gaps."""
    s_f0, s_f1, s_b1, s_b0 = shifts
    g_bottom_f, g_top, g_bottom_b = gaps
    out: list[BlockPass] = []
    f0 = [s_f0 * i for i in range(p)]
    f1_last = f0[-1] + 1 + (g_bottom_f - 1)
    f1 = [f1_last + s_f1 * (p - 1 - i) for i in range(p)]
    b1 = [f1[0] + g_top + s_b1 * i for i in range(p)]
    b0_last = b1[-1] + g_bottom_b
    b0 = [b0_last + s_b0 * (p - 1 - i) for i in range(p)]
    for i in range(p):
        out += [
            BlockPass(i, Kind.F, f0[i]), BlockPass(2 * p - 1 - i, Kind.F, f1[i]),
            BlockPass(2 * p - 1 - i, Kind.B, b1[i]), BlockPass(i, Kind.B, b0[i]),
        ]
    return out


def _collision_free(p: int, passes: list[BlockPass]) -> bool:
    seen: list[set[int]] = [set() for _ in range(p)]
    for bp in passes:
        rank = bp.stage if bp.stage < p else 2 * p - 1 - bp.stage
        if bp.start % T in seen[rank]:
            return False
        seen[rank].add(bp.start % T)
    return True


def v_block(p: int, shifts: tuple[int, int, int, int]) -> Block:
    """The V block with constant shifts (F0, F1, B1, B0 between neighbouring ranks).

    The three turn gaps (bottom F turn, top F1->B1, bottom B turn) are the smallest that
    keep F and B collision-free mod 6; the Ws then go into each rank's two free residues,
    earliest after their B. Among gap choices the smallest lifespan bound wins.
    """
    if p < 1:
        raise ScheduleError(f"p must be an integer >= 1, got {p!r}")
    placement = Placement.v_shape(p)
    best: tuple[float, int, Block] | None = None
    for gaps in product(range(1, T + 1), repeat=3):
        fb = _uniform_fb(p, shifts, gaps)
        if not _collision_free(p, fb):
            continue
        w_chain = [(bp.stage, Kind.W, 1) for bp in sorted(fb, key=lambda x: x.start) if bp.kind is Kind.B]
        try:
            block = fit_block(placement, fb, w_chain, interval=T)
        except ScheduleError:
            continue
        key = (max(block.lifespan_bound()), sum(gaps))
        if best is None or key < best[:2]:
            best = (*key, block)
    if best is None:
        raise ScheduleError(f"no V block with shifts {shifts} tiles for p={p}; choose other shifts")
    return best[2]


def v_fused_block(p: int) -> Block:
    """1F1B-V's block: F shifts 1, fused BW (two slots) placed earliest without collisions."""
    placement = Placement.v_shape(p)
    chain = [(i, Kind.F, 1) for i in range(p)] + [(2 * p - 1 - i, Kind.F, 1) for i in reversed(range(p))]
    chain += [(2 * p - 1 - i, Kind.BW, 2) for i in range(p)] + [(i, Kind.BW, 2) for i in reversed(range(p))]
    return fit_block(placement, (), chain, interval=T)


def _checked(p: int, m: int) -> None:
    for name, value in (("p", p), ("m", m)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be an integer >= 1, got {value!r}")


@register("v-min", "V shape, shifts 1/1: about 1/3 of 1F1B's activation memory")
def v_min(*, p: int, m: int, costs: object | None = None) -> Schedule:
    """V-Min: the V block with every shift 1, so each rank holds about 2p/3 chunk
    activations (p/3 in full-stage units, 1F1B holds p); bubble about 4p unit slots.

    p=4, m=8::

        (filled in below)
    """
    _checked(p, m)
    return build(v_block(p, (1, 1, 1, 1)), m, name="v-min", costs=costs)


@register("v-half", "V shape, shifts 2/1: about 1/2 of 1F1B's activation memory")
def v_half(*, p: int, m: int, costs: object | None = None) -> Schedule:
    """V-Half: the V block with downward shifts 2 and upward shifts 1; each rank holds
    about p chunk activations (p/2 in full-stage units); bubble about 3p unit slots.

    p=4, m=8::

        (filled in below)
    """
    _checked(p, m)
    return build(v_block(p, (2, 1, 2, 1)), m, name="v-half", costs=costs)


_ZB_SHIFTS = ((3, 3, 3, 3), (4, 2, 4, 2), (2, 4, 2, 4), (5, 1, 5, 1), (1, 5, 1, 5))


@register("v-zb", "V shape at 1F1B's memory (p): zero bubble at equal F/B/W costs")
def v_zb(*, p: int, m: int, costs: object | None = None) -> Schedule:
    """V-ZB: V blocks whose shifts sum to 6, so lifespans total about 12p slots per rank
    and the peak is 1F1B's (2p chunk activations, p in full-stage units). The block (and
    its reorder) with the shortest replayed makespan under `costs` is kept.

    p=4, m=8::

        (filled in below)
    """
    _checked(p, m)
    table = CostTable.of(Placement.v_shape(p), costs)
    limit = p * max(table.mem_b) / Placement.v_shape(p).stage_fraction if costs is not None else float(p)
    best = None
    for shifts in _ZB_SHIFTS:
        block = v_block(p, shifts)
        if max(block.lifespan_bound(table.mem_b)) > limit + 1e-9:
            continue
        orders, span, peaks = build_orders(block, m, costs=costs, memory_cap=limit)
        if best is None or span < best[0] - 1e-9:
            best = (span, orders)
    if best is None:
        raise ScheduleError(f"no V-ZB block fits 1F1B's memory for p={p}")
    return Schedule("v-zb", p, m, Placement.v_shape(p), best[1])


@register("1f1b-v", "V placement without B/W split (fused BW): about 2/3 of 1F1B's memory")
def one_f_one_b_v(*, p: int, m: int, costs: object | None = None) -> Schedule:
    """1F1B-V: V placement with the fused backward; F shifts 1, each BW (two slots) at the
    earliest collision-free slot. Peak about 2/3 of 1F1B's.

    p=4, m=8::

        (filled in below)
    """
    _checked(p, m)
    return build(v_fused_block(p), m, name="1f1b-v", costs=costs)
