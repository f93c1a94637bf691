"""DP units (block grain): the unit lists, the per-unit ops' text form and placement, and
the simulator's per-block sub-intervals."""
from __future__ import annotations

import dataclasses

import pytest

from pipeblocks.core import DPOp, Program, check_dp_ops, lower_for, parse_sharding, simulate
from pipeblocks.core.cost.costs import BlockCosts, Costs
from pipeblocks.core.cost.dp_model import DPCostModel, Link
from pipeblocks.core.ir.dp_units import DPUnits, check_dp_unit, units_for
from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.core.ir.ops import parse_op
from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.schedules import get
from pipeblocks.resolve.build import build

ZERO3 = parse_sharding("zero3")


def test_unit_lists_and_their_errors():
    assert units_for("chunk", (2, 2)) is None
    units = units_for("block", (2, 3), prefetch=2)
    assert units.sizes == ((1, 1), (1, 1, 1)) and units.prefetch == 2 and units.count(1) == 3
    assert units_for("block", (2, 3)).prefetch is None  # every unit gathered ahead
    assert DPUnits.from_sizes(((2,), (1, 2)), (2, 3)).blocks_of(1, 1) == range(1, 3)
    with pytest.raises(ValueError, match="--dp-unit 'layer': choose chunk .* or block"):
        check_dp_unit("layer")
    with pytest.raises(ValueError, match=r"unit 0 of stage 1 holds 1.5 blocks: it would end inside block 1 .* splitting"):
        DPUnits.from_sizes(((2,), (1.5, 0.5)), (2, 2))
    with pytest.raises(ValueError, match="the units of stage 0 hold 3 blocks but the stage has 2"):
        DPUnits.from_sizes(((1, 2), (2,)), (2, 2))
    with pytest.raises(ValueError, match="the unit list has 1 stages but the schedule has 2"):
        DPUnits.from_sizes(((2,),), (2, 2))
    with pytest.raises(ValueError, match=r"prefetch must be an integer >= 1 .* or None \(all of them\)"):
        DPUnits(((1,),), prefetch=0)


def test_bad_dp_unit_on_the_command_line(capsys):
    from pipeblocks.cli.main import main

    assert main(["simulate", "1f1b", "-p", "2", "-m", "2", "--dp", "2", "--dp-unit", "layer"]) != 0
    assert "--dp-unit: invalid choice: 'layer' (choose from 'chunk', 'block')" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--dp-unit 'layer'"):
        CostSpec(dp_unit="layer")


def test_per_unit_ops_round_trip_and_sit_where_the_chunk_op_sits():
    schedule = get("1f1b")(p=2, m=2)
    assert parse_op("1UNSHARD.1", schedule) == DPOp("UNSHARD", 1, 1) and str(DPOp("REDUCE_GRAD", 0, 3)) == "0REDUCE_GRAD.3"
    program = lower_for(schedule, policies=ZERO3, dp=2, units=units_for("block", (2, 2)))
    assert program.to_text() == (
        "0: 0UNSHARD.0 0UNSHARD.1 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0BW0 0RECV_B1 0BW1 "
        "0REDUCE_GRAD.1 0REDUCE_GRAD.0 0RESHARD.0 0RESHARD.1\n"
        "1: 1UNSHARD.0 1UNSHARD.1 1RECV_F0 1F0 1BW0 1SEND_B0 1RECV_F1 1F1 1BW1 1SEND_B1 "
        "1REDUCE_GRAD.1 1REDUCE_GRAD.0 1RESHARD.0 1RESHARD.1\n"
    )
    assert Program.from_text(program.to_text(), schedule) == program
    # a stage of one block is one unit: its ops read as at chunk grain
    chunk = lower_for(schedule, policies=ZERO3, dp=2)
    assert lower_for(schedule, policies=ZERO3, dp=2, units=units_for("block", (1, 1))) == chunk
    # prefetch 1 (FSDP2's one block ahead): the second unit right before the stage's first pass
    one = lower_for(schedule, policies=ZERO3, dp=2, units=units_for("block", (2, 2), prefetch=1))
    assert one.to_text().splitlines()[1].startswith("1: 1UNSHARD.0 1RECV_F0 1UNSHARD.1 1F0")


@pytest.mark.parametrize("name", ["zb-v", "interleaved-1f1b", "elastic", "bfs"])
@pytest.mark.parametrize("policy", ["replicate", "zero1", "zero3"])
def test_every_unit_reduced_once_and_gathered_before_its_stage_runs(name, policy):
    schedule = get(name)(p=2, m=4)
    units = units_for("block", (3,) * schedule.num_stages)
    program = lower_for(schedule, policies=parse_sharding(policy), dp=2, units=units, check=True)
    reduced = sorted((op.stage, op.unit) for ops in program.ranks for op in ops
                     if isinstance(op, DPOp) and op.kind == "REDUCE_GRAD")
    assert reduced == [(s, u) for s in range(schedule.num_stages) for u in range(3)]
    assert Program.from_text(program.to_text(), schedule) == program


def test_check_dp_ops_names_the_unit():
    schedule = get("1f1b")(p=2, m=2)
    units = units_for("block", (2, 2))
    program = lower_for(schedule, policies=ZERO3, dp=2, units=units)
    rank1 = [op for op in program.ranks[1] if op != DPOp("UNSHARD", 1, 1)]
    broken = Program(schedule, (program.ranks[0], tuple(rank1)))
    with pytest.raises(ScheduleError, match=r"stage 1 unit 1's parameters are sharded here; put 1UNSHARD.1 before it"):
        check_dp_ops(broken, ZERO3, units)
    with pytest.raises(ScheduleError, match=r"stage 0 has 2 unit\(s\), 0..1; name one of them"):
        check_dp_ops(Program(schedule, (program.ranks[0] + (DPOp("REDUCE_GRAD", 0, 5),), program.ranks[1])),
                     ZERO3, units)
    mixed = Program(schedule, (tuple(DPOp(op.kind, 0) if op == DPOp("UNSHARD", 0, 0) else op
                                     for op in program.ranks[0]), program.ranks[1]))
    with pytest.raises(ScheduleError, match="its DP ops name units .* and the whole stage too"):
        check_dp_ops(mixed)


def _costs(unit: str, prefetch: int | None = 1, policy: str = "zero3") -> Costs:
    model = DPCostModel(dp=2, sharding=parse_sharding(policy), link=Link(1.0), unit=unit, prefetch=prefetch)
    return Costs(params=4.0, blocks=BlockCosts.even((2,), (4.0,)), data_parallel=model)


def test_simulated_block_grain_by_hand():
    # one stage of two blocks, F = 1 and BW = 2; each unit's gather and reduce-scatter takes 4
    # (2 parameters x 4 bytes, half of it over a ring of 2 at 1 per time unit), the chunk's 8
    schedule = get("1f1b")(p=1, m=1)
    chunk = simulate(schedule, _costs("chunk"))
    assert [(e.op, e.start, e.end) for e in chunk.comm_events[0]] == [("0UNSHARD", 0, 8), ("0REDUCE_GRAD", 11, 19)]
    assert chunk.makespan == 19 and chunk.exposed_comm == (16,)
    block = simulate(schedule, _costs("block"))
    # unit 1's gather is issued when F starts on unit 0 (4); F runs unit 0 at 4-4.5, waits,
    # unit 1 at 8-8.5; BW runs unit 1 (8.5-9.5), then unit 0 (9.5-10.5), and each unit's
    # reduce-scatter starts when its blocks are done
    assert [(e.op, e.start, e.end) for e in block.comm_events[0]] == [
        ("0UNSHARD.0", 0, 4), ("0UNSHARD.1", 4, 8), ("0REDUCE_GRAD.1", 9.5, 13.5), ("0REDUCE_GRAD.0", 13.5, 17.5)]
    assert block.makespan == 17.5 and block.exposed_comm == (4 + 3.5 + 7,)
    # the pass is drawn ending where it ends, lasting its compute time
    assert [(e.start, e.end) for e in block.events[0]] == [(7.5, 8.5), (8.5, 10.5)]


def test_prefetch_depth_issues_later_units_earlier():
    # rank 1's stage: at prefetch 1 its second unit waits for the stage's first pass to
    # reach unit 0; by default both are gathered from the step's start, as at chunk grain
    schedule = get("1f1b")(p=2, m=4)
    costs = dataclasses.replace(_costs("block"), blocks=BlockCosts.even((2, 2), (2.0, 2.0)), params=(2.0, 2.0))
    one = simulate(schedule, costs)
    two = simulate(schedule, dataclasses.replace(
        costs, data_parallel=dataclasses.replace(costs.data_parallel, prefetch=None)))
    gathered = {e.op: e for e in two.comm_events[1]}
    assert gathered["1UNSHARD.1"].start == gathered["1UNSHARD.0"].end == 2
    assert {e.op: e for e in one.comm_events[1]}["1UNSHARD.1"].start > 2
    assert two.makespan < one.makespan


def test_chunk_grain_ignores_blocks_and_block_grain_without_blocks_is_chunk_grain():
    schedule = get("interleaved-1f1b")(p=2, m=4)
    plain = simulate(schedule, dataclasses.replace(_costs("chunk"), blocks=None, params=1.0))
    with_blocks = simulate(schedule, dataclasses.replace(_costs("chunk"), blocks=BlockCosts.even((3,) * 4, (1.0,) * 4),
                                                         params=(0.5,) * 4))  # a chunk holds 1/v of a stage
    assert plain == with_blocks
    assert simulate(schedule, dataclasses.replace(_costs("block"), blocks=None, params=1.0)) == plain


def test_block_grain_pipelines_reductions_for_every_policy():
    # replicated chunks: each unit's all-reduce starts as its blocks finish, never later than the chunk's
    schedule = get("zb-v")(p=2, m=4)
    for policy in ("replicate", "zero1", "zero2", "zero3"):
        costs = dataclasses.replace(_costs("chunk", policy=policy), params=(1.0,) * 4,
                                    blocks=BlockCosts.even((4,) * 4, (1.0,) * 4))
        chunk = simulate(schedule, costs)
        block = simulate(schedule, dataclasses.replace(
            costs, data_parallel=dataclasses.replace(costs.data_parallel, unit="block", prefetch=None)))
        assert block.makespan <= chunk.makespan + 1e-9, policy
        assert sum(block.comm_time) == pytest.approx(sum(chunk.comm_time)), policy


def test_analytic_blocks_match_the_stage_parameters():
    from pipeblocks.sim.analytic import MODELS, stage_params
    from pipeblocks.sim.blocks import transformer_blocks

    blocks = transformer_blocks(MODELS["6.2b"], num_stages=8)
    assert tuple(sum(b) for b in blocks.params) == tuple(float(n) for n in stage_params(MODELS["6.2b"], 8))
    request = ScheduleRequest(name="interleaved-1f1b", m=8, mesh=Mesh(pp=4, dp=16), options=(("v", 2),),
                              costs=CostSpec(model="6.2b", hardware="cloud", dp_unit="block"), sharding=ZERO3)
    built = build(request)
    text = built.program().to_text()
    assert "0REDUCE_GRAD.2 0REDUCE_GRAD.1 0REDUCE_GRAD.0" in text and "4UNSHARD.3" in text


def test_torch_csv_refuses_per_unit_ops():
    from pipeblocks.interop import program_to_torch_csv

    schedule = get("1f1b")(p=2, m=2)
    program = lower_for(schedule, policies=ZERO3, dp=2, units=units_for("block", (2, 2)))
    with pytest.raises(ScheduleError, match=r"rank 0 holds 0UNSHARD.0, .* lower it with --dp-unit chunk"):
        program_to_torch_csv(program)
