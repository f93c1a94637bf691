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

from ..core.actions import Kind
from ..core.errors import ScheduleError
from ..core.placement import Placement
from ..core.schedule import Schedule
from .blocks import Block, BlockPass, build, fit_block
from .registry import register

__all__ = ["v_block", "v_block_from_offsets", "v_fused_block", "v_min", "v_half", "v_zb", "one_f_one_b_v"]

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
    """A V block from per-rank offsets: rank i starts F0 at down[i] and B1 at
    down[i] + c, F1 at a + up[i] and B0 at b + up[i] (down[0] = up[p-1] = 0).

    The three turn gaps (bottom F turn, top F1->B1, bottom B turn) fixing a, b and c
    are the smallest in 1..6 that keep F and B collision-free mod 6; the Ws then go into
    each rank's free residues, earliest after their B. Among tiling gap choices the
    smallest lifespan bound wins.
    """
    if p < 1:
        raise ScheduleError(f"p must be an integer >= 1, got {p!r}")
    placement = Placement.v_shape(p)
    best: tuple[tuple[float, int], Block] | None = None
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
                if best is None or key < best[0]:
                    best = (key, block)
    if best is None:
        raise ScheduleError(f"no V block with these offsets tiles for p={p}: F and B collide mod {T}; choose other shifts")
    return best[1]


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


@register("v-zb", "V shape at 1F1B's memory (p): zero bubble at equal F/B/W costs")
def v_zb(*, p: int, m: int, costs: object | None = None) -> Schedule:
    """V-ZB: the V block with downward shifts 4 and upward shifts 2 (their sum 6 is the
    interval), so each rank's lifespans total about 12p slots and the peak is 1F1B's:
    2p chunk activations, p in full-stage units. At equal F/B/W costs no rank idles
    between its first and last pass; the last rank starts p-1 slots late.

    p=4, m=8::

        (filled in below)
    """
    _checked(p, m)
    return build(v_block(p, (4, 2, 4, 2)), m, name="v-zb", costs=costs)


@register("1f1b-v", "V placement without B/W split (fused BW): about 2/3 of 1F1B's memory")
def one_f_one_b_v(*, p: int, m: int, costs: object | None = None) -> Schedule:
    """1F1B-V: V placement with the fused backward; F shifts 1, each BW (two slots) at the
    earliest collision-free slot. Peak about 2/3 of 1F1B's.

    p=4, m=8::

        (filled in below)
    """
    _checked(p, m)
    return build(v_fused_block(p), m, name="1f1b-v", costs=costs)
