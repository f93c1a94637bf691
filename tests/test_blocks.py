"""The building-block API: tiling, lifespans and their memory bound, building schedules."""
from __future__ import annotations

import pytest

from pipeblocks.core import Kind, Placement, ScheduleError, validate
from pipeblocks.schedules._reorder import cost_table, peaks_of, replay
from pipeblocks.schedules.blocks import (
    Block,
    BlockPass,
    build,
    build_orders,
    fit_block,
    tile,
)
from pipeblocks.schedules.vshape import v_block, v_fused_block
from pipeblocks.sim import Costs, simulate

# ZB-H1's shape on two ranks: rank 0 runs F, B, W of stage 0; rank 1 those of stage 1.
H1 = "0F@0 1F@1 1B@2 1W@3 0B@4 0W@5"


def one_f_one_b_block(p: int) -> Block:
    """1F1B as a block: F down the ranks, fused BW (two slots) back up, interval 3."""
    passes = [BlockPass(s, Kind.F, s) for s in range(p)]
    passes += [BlockPass(s, Kind.BW, p + 2 * (p - 1 - s), 2) for s in range(p)]
    return Block(Placement.loop(p), tuple(passes), 3)


def test_text_form_round_trips():
    blk = Block.parse(Placement.loop(2), H1, interval=3)
    assert Block.parse(Placement.loop(2), blk.to_text(), interval=3) == blk
    assert str(BlockPass.parse("3BW@7:2")) == "3BW@7:2"
    with pytest.raises(ScheduleError, match="expected <stage><F|B|W|BW>@<start>"):
        BlockPass.parse("3X@7")


def test_lifespans_and_bound_of_a_hand_block():
    blk = Block.parse(Placement.loop(2), H1, interval=3)
    assert blk.lifespans == (6, 3)  # stage 0: F at 0 .. W ends at 6; stage 1: F at 1 .. W ends at 4
    assert blk.lifespan_bound() == (2.0, 1.0)
    assert blk.lifespan_bound(mem_b=3.0) == (6.0, 3.0)
    assert blk.diagram().splitlines()[0].split() == ["0:", "0F", ".", ".", ".", "0B", "0W"]


def test_collision_is_reported_with_both_passes():
    # 0B at slot 3 lands on 0F's residue 0 mod 3: microbatch j's F meets microbatch j-1's B
    with pytest.raises(ScheduleError) as err:
        Block.parse(Placement.loop(2), "0F@0 1F@1 1B@2 1W@3 0B@3 0W@4", interval=3)
    text = str(err.value)
    assert "does not tile" in text and "0F@0" in text and "0B@3" in text and "rank 0" in text
    assert "free residue (2)" in text


def test_v_min_without_its_correction_collides_for_p_divisible_by_3():
    # V-Min's B1 at 2p (no +2 correction) shares device 0's F0 residue when 3 divides p
    p = 3
    passes = []
    for i in range(p):
        passes += [BlockPass(i, Kind.F, i), BlockPass(2 * p - 1 - i, Kind.F, 2 * p - 1 - i),
                   BlockPass(2 * p - 1 - i, Kind.B, 2 * p + i), BlockPass(i, Kind.B, 4 * p - 1 - i)]
    passes += [BlockPass(s, Kind.W, 40 + s) for s in range(2 * p)]
    with pytest.raises(ScheduleError, match=r"0F@0 \(slot 0\) and 5B@6 \(slot 6\)"):
        Block(Placement.v_shape(p), tuple(passes), 6)


def test_too_much_work_for_the_interval():
    with pytest.raises(ScheduleError, match="raise the interval to at least 3"):
        Block.parse(Placement.loop(2), H1, interval=2)


def test_dependency_inside_the_block_is_checked():
    with pytest.raises(ScheduleError, match=r"0B@1 starts at slot 1, before 1B ends at slot 3"):
        Block.parse(Placement.loop(2), "0F@0 1F@1 1B@2 1W@3 0B@1 0W@5", interval=6)


@pytest.mark.parametrize(
    "text, missing",
    [("0F@0 1F@1 1B@2 1W@3 0B@4", "stage 0's W"), ("0F@0 1F@1 1BW@2:2 0B@4 0W@5 1W@6", "both BW and B/W")],
)
def test_incomplete_blocks_are_rejected(text, missing):
    with pytest.raises(ScheduleError, match=missing):
        Block.parse(Placement.loop(2), text, interval=6)


def test_fit_block_places_passes_or_explains():
    placement = Placement.loop(2)
    fixed = (BlockPass(0, Kind.F, 0), BlockPass(1, Kind.F, 1))
    blk = fit_block(placement, fixed, [(1, Kind.B, 1), (0, Kind.B, 1), (1, Kind.W, 1), (0, Kind.W, 1)], interval=3)
    assert blk.pass_of(0, Kind.B).start == 4  # slot 3 is F's residue on rank 0
    with pytest.raises(ScheduleError, match="no tiling with interval T=2"):
        fit_block(placement, fixed, [(1, Kind.BW, 2), (0, Kind.BW, 2)], interval=2)


def test_tile_repeats_every_interval():
    blk = Block.parse(Placement.loop(2), H1, interval=3)
    rows = tile(blk, 3)
    assert [(t, str(a)) for t, a in rows[1]] == [
        (1, "1F0"), (2, "1B0"), (3, "1W0"), (4, "1F1"), (5, "1B1"), (6, "1W1"), (7, "1F2"), (8, "1B2"), (9, "1W2")
    ]
    with pytest.raises(ScheduleError, match="m must be an integer >= 1"):
        tile(blk, 0)


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_one_f_one_b_as_a_block(p):
    blk = one_f_one_b_block(p)
    assert max(blk.lifespan_bound()) == p  # stage 0 lives 3p slots: p microbatches at interval 3
    s = build(blk, 2 * p + 1, name="1f1b-block")
    validate(s)
    tl = simulate(s)
    assert max(tl.peak_activation) == p
    # 1F1B's bubble: (p-1)(T_F + T_B + T_W) = 3(p-1) at unit costs
    assert tl.makespan - max(tl.busy(r) for r in range(p)) == pytest.approx(3 * (p - 1))


def _blocks(p: int):
    yield "v-min", v_block(p, (1, 1, 1, 1))
    yield "v-half", v_block(p, (2, 1, 2, 1))
    yield "v-zb", v_block(p, (4, 2, 4, 2))
    yield "1f1b-v", v_fused_block(p)
    yield "1f1b", one_f_one_b_block(p)


@pytest.mark.sweep
@pytest.mark.parametrize("p", range(2, 17))
def test_lifespan_bound_holds_for_every_block_built_schedule(p):
    for name, blk in _blocks(p):
        for m in (max(1, p - 1), 2 * p + 1):
            s = build(blk, m, name=name)
            validate(s)
            peaks = simulate(s).peak_activation
            bound = blk.lifespan_bound()
            assert all(x <= b + 1e-9 for x, b in zip(peaks, bound)), (name, p, m, peaks, bound)


def test_memory_cap_is_respected_and_explained():
    blk = v_block(6, (2, 1, 2, 1))  # V-Half: its own peak is 4 at p=6
    _, (natural, _), own = build_orders(blk, 13)
    _, (roomy, _), peaks = build_orders(blk, 13, memory_cap=5.0)
    assert max(own) == 4.0 and 4.0 < max(peaks) <= 5.0
    assert roomy < natural  # the extra budget goes into warm-up forwards and shortens the step
    with pytest.raises(ScheduleError, match="fits the memory cap 3.5 .the tiled schedule needs 4"):
        build_orders(blk, 13, memory_cap=3.5)


@pytest.mark.parametrize("costs", [Costs(), Costs(1.0, 2.0, 0.5, 0.1), Costs(2.0, 1.0, 1.5, 0.3, mem_w_ratio=0.5)])
def test_replay_agrees_with_the_simulator(costs):
    blk = v_block(5, (2, 1, 2, 1))
    s = build(blk, 9, costs=costs)
    table = cost_table(s.placement, costs)
    makespan, span = replay(s.ranks, table)
    tl = simulate(s, costs)
    assert makespan == pytest.approx(tl.makespan)
    assert span == pytest.approx(max(e[-1].end - e[0].start for e in tl.events))


def _timed(blk, m):
    rows = [[] for _ in range(blk.p)]
    for j in range(m):
        for bp in blk.passes:
            rows[blk.rank_of(bp)].append((bp.start + j * blk.interval, bp.length, bp.action(j)))
    return rows


@pytest.mark.parametrize("costs", [Costs(), Costs(2.0, 1.0, 1.5, 0.3, mem_w_ratio=0.5)])
def test_fast_compaction_equals_the_slot_grid_specification(costs):
    from _slow_compact import compact as slow_compact

    from pipeblocks.schedules._reorder import compact
    from pipeblocks.schedules.vshape import two_part_block, v_block, v_fused_block

    blocks = [v_block(4, (1, 1, 1, 1)), v_block(5, (2, 1, 2, 1)), v_block(4, (4, 2, 4, 2)), v_fused_block(4),
              two_part_block(6, 3, 1, 3), Block.parse(Placement.loop(2), "0F@0 1F@1 1B@2 1W@3 0B@3 0W@5", interval=4)]
    for blk in blocks:
        table = cost_table(blk.placement, costs)
        for m in (1, 3, 2 * blk.p + 1):
            tiled = peaks_of(tuple(tuple(a for _, _, a in sorted(row, key=lambda x: x[0])) for row in _timed(blk, m)), table)
            for caps in (tiled, tuple(c + 1.0 for c in tiled), tuple(0.5 * c for c in tiled)):
                for float_weights in (False, True):
                    fast = compact(_timed(blk, m), table, caps, float_weights=float_weights)
                    slow = slow_compact(_timed(blk, m), table, caps, float_weights=float_weights)
                    assert fast == slow, (blk.to_text(), m, caps, float_weights)


@pytest.mark.parametrize("name", ["zb", "zb-v", "v-half"])
def test_replay_spans_and_peaks_equal_the_simulator(name):
    from pipeblocks.schedules import get
    from pipeblocks.schedules._reorder import replay_spans

    costs = Costs(3.0, 4.0, 2.0, 0.25, mem_w_ratio=0.5)
    s = get(name)(p=4, m=7, costs=costs, search=5)
    tl = simulate(s, costs)
    makespan, spans = replay_spans(s.ranks, cost_table(s.placement, costs))
    assert makespan == tl.makespan
    assert spans == tuple(tl.span(r) for r in range(s.p))
    assert peaks_of(s.ranks, cost_table(s.placement, costs)) == tl.peak_activation
    swapped = [list(r) for r in s.ranks]
    swapped[0][0], swapped[0][-1] = swapped[0][-1], swapped[0][0]  # a W before its own B: cannot run
    assert replay_spans(tuple(map(tuple, swapped)), cost_table(s.placement, costs)) is None
