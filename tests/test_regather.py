"""zero3-regather: a zero3 chunk freed between its visits and gathered again. The policy
name, the lowering (where it frees and gathers), its checks and errors, the simulator's
traced memory and extra gathers, and the searches that may choose it."""
from __future__ import annotations

import dataclasses
import json

import pytest

from pipeblocks.core.cost.costs import Costs
from pipeblocks.core.cost.dp_model import DPCostModel, Link
from pipeblocks.core.ir.dp_units import DPUnits
from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.core.lowering.entry import lower_for
from pipeblocks.core.lowering.passes_dp import check_dp_ops
from pipeblocks.core.ir.ops import DPOp
from pipeblocks.core.ir.program import Program
from pipeblocks.core.ir.sharding import ShardingPolicy, parse_sharding
from pipeblocks.core.simulator.simulate import simulate
from pipeblocks.schedules import get
from pipeblocks.resolve.auto_sharding import choose_sharding
from pipeblocks.resolve.elastic_plan import choose_elastic_plan

REGATHER = ShardingPolicy.ZERO3_REGATHER


def _bfs_order(m: int = 8):
    """Elastic with one group of m: each chunk's forwards, then backwards, breadth-first."""
    return get("elastic")(p=2, m=m, v=2, forward_groups=(m,), backward_groups=(m,))


def _costs(policy, dp: int = 2, bandwidth: float = 4.0) -> Costs:
    return Costs(data_parallel=DPCostModel(dp=dp, sharding=tuple(parse_sharding(policy)), link=Link(bandwidth)))


def _text(program: Program, rank: int) -> str:
    return " ".join(map(str, program.ranks[rank]))


def test_the_policy_parses_per_chunk_and_keeps_zero3():
    assert parse_sharding("zero3,zero3-regather") == (ShardingPolicy.ZERO3, REGATHER)
    assert str(REGATHER) == "zero3-regather"
    assert REGATHER.shards_parameters and REGATHER.regathers and REGATHER.fsdp
    assert REGATHER.storage is ShardingPolicy.ZERO3
    assert not ShardingPolicy.ZERO3.regathers and ShardingPolicy.ZERO3.storage is ShardingPolicy.ZERO3
    with pytest.raises(ValueError, match="zero3-regather"):  # the choices name it
        parse_sharding("zero4")


def test_a_chunk_is_freed_after_its_forwards_and_gathered_again_halfway_down_the_other_chunks_backwards():
    program = lower_for(_bfs_order(4), policies=("zero3-regather",), dp=2, check=True)
    assert _text(program, 0) == (
        "0UNSHARD 2UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0F3 0SEND_F3 0RESHARD "
        "2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 2RECV_F2 2F2 2SEND_F2 2RECV_F3 2F3 2SEND_F3 "
        "2RECV_B0 2BW0 2SEND_B0 2RECV_B1 2BW1 2SEND_B1 0UNSHARD 2RECV_B2 2BW2 2SEND_B2 2RECV_B3 2BW3 2SEND_B3 "
        "2REDUCE_GRAD 2RESHARD 0RECV_B0 0BW0 0RECV_B1 0BW1 0RECV_B2 0BW2 0RECV_B3 0BW3 0REDUCE_GRAD 0RESHARD"
    )
    # zero3 is unchanged: gathered once, freed after its reduction
    zero3 = lower_for(_bfs_order(4), policies=("zero3",), dp=2)
    assert [str(op) for op in zero3.ranks[0] if type(op) is DPOp] == [
        "0UNSHARD", "2UNSHARD", "2REDUCE_GRAD", "2RESHARD", "0REDUCE_GRAD", "0RESHARD"]


def test_a_1f1b_alternation_between_two_chunks_keeps_both_gathered():
    """elastic p=2 m=4 groups 2,2: rank 0 alternates its chunks one pass at a time (its
    activations crest at its own passes), so nothing is freed there; rank 1 frees both
    chunks between their groups."""
    schedule = get("elastic")(p=2, m=4, v=2, forward_groups=(2, 2), backward_groups=(2, 2))
    program = lower_for(schedule, policies=("zero3-regather",), dp=2, check=True)
    frees = [[str(op) for op in ops if type(op) is DPOp and op.kind == "RESHARD"] for ops in program.ranks]
    assert frees[0] == ["2RESHARD", "0RESHARD"]
    assert frees[1] == ["1RESHARD", "3RESHARD", "1RESHARD", "3RESHARD", "1RESHARD"]


def test_per_chunk_and_per_unit():
    """One policy per chunk; at block grain every unit is freed and gathered again, and
    with prefetch 1 only the first unit goes where the chunk's gather goes."""
    schedule = _bfs_order(4)
    mixed = lower_for(schedule, policies=parse_sharding("zero3-regather,zero3,zero3,zero3"), dp=2)
    assert [str(op) for op in mixed.ranks[0] if type(op) is DPOp].count("0UNSHARD") == 2
    assert [str(op) for op in mixed.ranks[1] if type(op) is DPOp].count("1UNSHARD") == 1
    units = DPUnits.per_block((2, 2, 2, 2))
    block = _text(lower_for(schedule, policies=("zero3-regather",), dp=2, units=units, check=True), 0)
    assert "0F3 0SEND_F3 0RESHARD.0 0RESHARD.1 2RECV_F0" in block
    assert "2SEND_B1 0UNSHARD.0 0UNSHARD.1 2RECV_B2" in block
    ahead = _text(lower_for(schedule, policies=("zero3-regather",), dp=2, units=DPUnits.per_block((2, 2, 2, 2), prefetch=1),
                            check=True), 0)
    assert "2SEND_B1 0UNSHARD.0 2RECV_B2" in ahead and "0RECV_B0 0UNSHARD.1 0BW0" in ahead


def test_the_check_still_wants_the_parameters_gathered_for_every_pass():
    program = lower_for(_bfs_order(4), policies=("zero3-regather",), dp=2)
    ops = list(program.ranks[0])
    regather = [i for i, op in enumerate(ops) if str(op) == "0UNSHARD"][1]
    del ops[regather]
    broken = Program(program.schedule, (tuple(ops), program.ranks[1]))
    with pytest.raises(ScheduleError, match=r"rank 0, op \d+ \(0BW0\): stage 0's parameters are sharded here; "
                                            "put 0UNSHARD before it"):
        check_dp_ops(broken, ("zero3-regather",))


def test_a_chunk_alone_on_its_rank_cannot_regather():
    with pytest.raises(ScheduleError, match=r"--sharding zero3-regather on stage 0: rank 0 runs no other chunk, .*"
                                            r"give stage 0 zero3, or use a schedule with several chunks per rank"):
        lower_for(get("1f1b")(p=2, m=4), policies=("zero3-regather",), dp=2)


def test_the_simulator_traces_the_freed_parameters_with_the_activations():
    """Breadth-first order, unit costs, d=2: a chunk's gathered fp32 parameters are 2 units
    (0.5 parameters x 4 bytes). zero3 needs static memory at the peak (14) plus peak
    activation (8); zero3-regather holds chunk 0 only away from the crest: 2 less, at the
    same step time (its regather hides under chunk 1's backwards)."""
    schedule = _bfs_order()
    zero3 = simulate(schedule, _costs("zero3"))
    released = simulate(schedule, _costs("zero3-regather"))
    assert zero3.memory_peak == () and zero3.memory_need == (22.0, 22.0)
    assert zero3.memory_need == tuple(s + a for s, a in zip(zero3.static_memory_peak, zero3.peak_activation))
    assert released.static_memory_peak == zero3.static_memory_peak  # the closed form is the same
    assert released.memory_peak == released.memory_need == (20.0, 20.0)
    assert released.makespan == zero3.makespan
    gathers = [[e.op for e in events if "UNSHARD" in e.op] for events in released.comm_events]
    assert gathers == [["0UNSHARD", "2UNSHARD", "0UNSHARD"], ["1UNSHARD", "3UNSHARD", "1UNSHARD"]]
    summary = released.summary()
    assert summary["memory_peak"] == [20.0, 20.0] and "memory_peak" not in zero3.summary()
    json.dumps(summary)


def test_a_rank_without_a_regathering_chunk_keeps_the_conservative_figure():
    schedule = _bfs_order()
    mixed = simulate(schedule, _costs("zero3-regather,zero3,zero3-regather,zero3"))  # rank 0's chunks only
    assert mixed.memory_peak[0] == 20.0
    assert mixed.memory_peak[1] == mixed.static_memory_peak[1] + mixed.peak_activation[1] == 22.0


def test_regathering_costs_link_time_where_it_cannot_hide():
    """Depth-first groups: a chunk is freed for two passes of the other and gathered again
    right before its own, on a link where a gather takes 1 time unit: exposed."""
    schedule = get("elastic")(p=2, m=8, v=2, forward_groups=(2, 2, 2, 2), backward_groups=(2, 2, 2, 2))
    zero3 = simulate(schedule, _costs("zero3"))
    released = simulate(schedule, _costs("zero3-regather"))
    assert released.makespan > zero3.makespan
    assert sum(released.exposed_comm) > sum(zero3.exposed_comm)


def test_sharding_auto_chooses_it_only_where_the_budget_needs_it():
    """d=8, breadth-first order: every other policy needs 17 or more per rank (zero1 17,
    zero2 and zero3 17.5, replicate 24); zero3-regather on the first chunk of each rank
    needs 15.5. Under 16 the search picks it there; under a generous budget it keeps zero3
    (the same step time, fewer gathers)."""
    schedule, costs = _bfs_order(), _costs("zero3", dp=8)
    needs = {p: max(simulate(schedule, _costs(p, dp=8)).memory_need) for p in ShardingPolicy}
    assert needs == {ShardingPolicy.REPLICATE: 24.0, ShardingPolicy.ZERO1: 17.0, ShardingPolicy.ZERO2: 17.5,
                     ShardingPolicy.ZERO3: 17.5, REGATHER: 15.5}
    assert choose_sharding(schedule, costs, memory_budget=16) == (REGATHER, REGATHER) + (ShardingPolicy.ZERO3,) * 2
    assert choose_sharding(schedule, costs, memory_budget=100) == (ShardingPolicy.ZERO3,) * 4
    with pytest.raises(ScheduleError, match="no assignment fits --gpu-memory; the least found needs 15.5"):
        choose_sharding(schedule, costs, memory_budget=15)


def test_sharding_auto_leaves_it_out_where_it_cannot_apply():
    assert REGATHER not in choose_sharding(get("1f1b")(p=2, m=4), _costs("zero3", dp=8), memory_budget=100)


def test_the_elastic_joint_search_frees_chunks_to_fit_larger_groups():
    """d=8 on a link of 0.5 units per time unit: one group of 8 (breadth-first) is the
    fastest order but needs 17.5 under zero3. Under 16 the joint search keeps it by freeing
    each rank's first chunk between its forwards and backwards (32.5, against 33.0 for the
    best zero3 plan that fits); under a generous budget it keeps zero3. On a link of 0.25
    the regather would be exposed, so it picks smaller groups under zero3 instead."""
    costs = _costs("zero3", dp=8, bandwidth=0.5)
    tight = choose_elastic_plan(2, 8, 2, costs, budget=16, recompute=False, start=(ShardingPolicy.ZERO3,))
    assert dict(tight.schedule.options)["forward_groups"] == (8,)
    assert tight.sharding == (REGATHER, REGATHER, ShardingPolicy.ZERO3, ShardingPolicy.ZERO3)
    assert tight.makespan == 32.5 and tight.groups_only == 33.0
    generous = choose_elastic_plan(2, 8, 2, costs, budget=100, recompute=False, start=(ShardingPolicy.ZERO3,))
    assert generous.sharding == (ShardingPolicy.ZERO3,) * 4 and generous.makespan == 32.5
    slow = dataclasses.replace(costs, data_parallel=dataclasses.replace(costs.data_parallel, link=Link(0.25)))
    exposed = choose_elastic_plan(2, 8, 2, slow, budget=16, recompute=False, start=(ShardingPolicy.ZERO3,))
    assert REGATHER not in exposed.sharding


def test_predicted_static_peak_follows_the_regathers():
    """The runtime's prediction walks the Program: a chunk freed between visits is not
    counted there; here the walk's peak (stage 2's reduction, every chunk gathered) is
    zero3's, and on a Program whose regather comes later it is lower."""
    from pipeblocks.core.cost.precision import precision_policy
    from pipeblocks.core.cost.static_memory import chunk_bytes, predict_static_peak

    shapes = {0: [(64, 16)], 2: [(64, 16)]}
    fp64 = precision_policy("fp64")

    def peak(program, policy, gather_ahead=False):
        # the step's own walk; with gather_ahead the opening gathers are also held after the
        # optimizer step (checked at the end)
        return predict_static_peak(program, 0, shapes, (policy,) * 4, dp=2, dp_rank=0, precision=fp64,
                                   gather_ahead=gather_ahead)

    schedule = _bfs_order(4)
    zero3 = peak(lower_for(schedule, policies=("zero3",), dp=2), ShardingPolicy.ZERO3)
    program = lower_for(schedule, policies=("zero3-regather",), dp=2)
    assert peak(program, REGATHER) == zero3
    # the same Program with stage 0 gathered again only after stage 2's reduction and free
    ops = [op for op in program.ranks[0]]
    again = [i for i, op in enumerate(ops) if str(op) == "0UNSHARD"][1]
    gather = ops.pop(again)
    ops.insert(ops.index(DPOp("RESHARD", 2, None)) + 1, gather)
    later = Program(schedule, (tuple(ops), program.ranks[1]))
    piece = chunk_bytes(shapes[0], policy=REGATHER, d=2, precision=fp64)
    assert zero3 - piece.gathered <= peak(later, REGATHER) < zero3
    # gathering ahead: after the optimizer step both chunks (the Program's leading UNSHARDs) are
    # gathered beside their shards, reduced gradients and state
    after_step = 2 * (piece.params + piece.gathered + piece.grads_reduced + piece.optimizer)
    assert peak(later, REGATHER, gather_ahead=True) == max(peak(later, REGATHER), after_step)
