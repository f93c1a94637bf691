"""DualPipeV and the overlapped forward-backward op: the generator against the worked order
and torch's, the text forms, the simulator's closed forms, memory and overlap price, and the
consumers that refuse the op."""
from __future__ import annotations

import pytest

from pipeblocks.core import Costs, ScheduleError, simulate
from pipeblocks.core.lowering.entry import lower_for
from pipeblocks.core.ir.ops import Overlap, UnknownOpError
from pipeblocks.core.ir.program import Program
from pipeblocks.core.ir.schedule import Schedule
from pipeblocks.core.lowering.validate import check_structure
from pipeblocks.interop import from_torch_csv, to_torch_csv
from pipeblocks.schedules import get

pytestmark = pytest.mark.fast

# DualPipeV at p = 2, m = 4 (DeepSeek's program; torch's ScheduleDualPipeV lists the same
# order, written 3I0 for our 3B0, 3B1 for our 3BW1 and (0F3;3B1)OVERLAP_F_B for 0F3&3BW1)
WORKED = (
    "0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3&3BW1 3F2&0BW0 3BW2 3F3&0BW1 3BW3 0B2 0W2 0B3 0W3",
    "1F0 2F0 1F1 2F1 1F2 2BW0 2F2&1BW0 1F3&2BW1 2F3&1BW1 2BW2 1BW2 2B3 1B3 2W3 1W3",
)


def test_worked_order_p2_m4():
    schedule = get("dualpipev")(p=2, m=4)
    rows = schedule.to_text().splitlines()[1:]
    assert [row.split(": ", 1)[1] for row in rows] == list(WORKED)
    assert schedule.placement.stage_to_rank == (0, 1, 1, 0)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 8)])
def test_text_json_and_program_round_trip(p, m):
    schedule = get("dualpipev")(p=p, m=m)
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert Schedule.from_json(schedule.to_json()) == schedule
    program = lower_for(schedule, check=True)
    assert any(type(op) is Overlap for ops in program.ranks for op in ops)
    assert Program.from_text(program.to_text(), schedule) == program


def test_pair_waits_for_both_inputs_and_sends_after():
    program = lower_for(get("dualpipev")(p=2, m=4))
    ops = [str(op) for op in program.ranks[0]]
    at = ops.index("3F2&0BW0")
    assert ops[at - 2:at] == ["3RECV_F2", "0RECV_B0"]  # both inputs before the pair
    ops1 = [str(op) for op in program.ranks[1]]
    at = ops1.index("2F2&1BW0")
    assert ops1[at + 1:at + 3] == ["2SEND_F2", "1SEND_B0"]  # both outputs after it


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("factor", [2, 3])
def test_bubble_matches_closed_form_at_equal_costs(p, factor):
    # one slot = one chunk pass = half a full stage's pass; DeepSeek semantics (both inputs
    # awaited): makespan 6m + 2(p-1) slots, rank r idle 2(p-1) - r slots inside its span,
    # peak 2p+1 chunk activations on every rank (ZB-V: 6m + p - 1, 0 idle, 2p)
    m = factor * p
    slot = 0.5
    timeline = simulate(get("dualpipev")(p=p, m=m), Costs())
    assert timeline.makespan == pytest.approx((6 * m + 2 * (p - 1)) * slot)
    for r in range(p):
        span = timeline.rank_end(r) - timeline.events[r][0].start
        assert span - timeline.busy(r) == pytest.approx((2 * (p - 1) - r) * slot)
        assert timeline.peak_activation[r] == pytest.approx((2 * p + 1) * slot)
    zbv = simulate(get("zb-v")(p=p, m=m), Costs())
    assert zbv.makespan == pytest.approx((6 * m + p - 1) * slot)
    assert max(zbv.peak_activation) == pytest.approx(2 * p * slot)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 13)])
def test_overlap_hides_its_declared_time_per_pair(p, m):
    schedule = get("dualpipev")(p=p, m=m)
    plain = simulate(schedule, Costs())
    hidden = 0.2  # per full stage: a chunk pair hides 0.1
    gained = simulate(schedule, Costs(overlap=hidden))
    for r in range(p):
        pairs = 2 * m - 3 * p + r + 1 if r < p - 1 else 2 * m - 2 * p - 1
        assert sum(1 for op in lower_for(schedule).ranks[r] if type(op) is Overlap) == pairs
        assert plain.busy(r) - gained.busy(r) == pytest.approx(pairs * hidden / 2)
    assert gained.makespan < plain.makespan
    # the peak holds the pair's transient +1 activation either way
    assert gained.peak_activation == plain.peak_activation


def test_bad_m_names_the_nearest_valid_m():
    with pytest.raises(ScheduleError, match=r"p=4 takes m >= 8, got m=6; use -m 8"):
        get("dualpipev")(p=4, m=6)


def test_marked_pairs_are_checked():
    head = "# pipeblocks schedule s p=1 m=2 placement=loop stages=0\n"
    with pytest.raises(ScheduleError, match="an overlapped pair is two actions"):
        Schedule.from_text(head + "0: 0F0&0F1&0BW0 0BW1\n")
    with pytest.raises(ScheduleError, match="fused backward \\(BW\\) of another unit"):
        check_structure(Schedule.from_text(head + "0: 0F0 0F1&0B0 0W0 0BW1\n"))
    bad = Schedule.from_text("# pipeblocks schedule s p=1 m=2 placement=loop stages=0\n0: 0F0&0BW0 0F1 0BW1\n")
    with pytest.raises(ScheduleError, match="fused backward \\(BW\\) of another unit"):
        check_structure(bad)


def test_recompute_and_async_refuse_pairs():
    schedule = get("dualpipev")(p=2, m=4)
    with pytest.raises(UnknownOpError, match="recomputation"):
        lower_for(schedule, recompute=[(0, 1)])
    with pytest.raises(UnknownOpError, match="asynchronous"):
        lower_for(schedule, extra_passes=(lambda program: program,))


def test_dp_lowering_around_pairs():
    from pipeblocks.core.cost.dp_model import DPCostModel

    schedule = get("dualpipev")(p=2, m=4)
    program = lower_for(schedule, policies=["zero3"], dp=2, check=True)
    text = program.to_text()
    assert "REDUCE_GRAD" in text and "UNSHARD" in text and "&" in text
    timeline = simulate(schedule, Costs(data_parallel=DPCostModel(dp=2, sharding=("zero3",))))
    assert timeline.makespan > 0


def test_torch_csv_keeps_the_pairs():
    schedule = get("dualpipev")(p=2, m=4)
    text = to_torch_csv(schedule)
    assert "(0F3;3B1)OVERLAP_F_B" in text.splitlines()[0].split(",")
    back = from_torch_csv(text, placement="v", name="dualpipev")
    assert back.ranks == schedule.ranks and back.overlapped == schedule.overlapped


@pytest.mark.torch
@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 8), (4, 11)])
def test_torch_schedule_dualpipev_imports_equal_and_simulates(p, m):
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    from pipeblocks.interop import from_torch_rows

    torch_schedule = object.__new__(ScheduleDualPipeV)  # only its action lists: no stages, no process group
    torch_schedule.pp_group_size, torch_schedule._n_microbatches = p, m
    rows = [[str(a) for a in torch_schedule._calculate_single_rank_operations(r) if a is not None] for r in range(p)]
    imported = from_torch_rows(rows, placement="v", m=m)
    ours = get("dualpipev")(p=p, m=m)
    assert imported.ranks == ours.ranks and imported.overlapped == ours.overlapped
    assert simulate(imported, Costs()).makespan == pytest.approx((6 * m + 2 * (p - 1)) * 0.5)


# ---- DualPipe: two directions, two chains on the V placement ---------------------------------

@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("factor", [2, 3])
def test_dualpipe_bubble_and_memory_match_closed_forms(p, factor):
    # a slot is one full-stage pass here (each stage is a whole model stage, held twice):
    # makespan 3m + p - 2, rank r idle 2(p/2 - 1) - min(r, p-1-r), peak p + 1 activations
    m = factor * p
    schedule = get("dualpipe")(p=p, m=m)
    timeline = simulate(schedule, Costs())
    assert timeline.makespan == pytest.approx(3 * m + p - 2)
    for r in range(p):
        span = timeline.rank_end(r) - timeline.events[r][0].start
        assert span - timeline.busy(r) == pytest.approx(2 * (p // 2 - 1) - min(r, p - 1 - r))
        assert timeline.peak_activation[r] == pytest.approx(p + 1)
    # every rank holds two whole stages' parameters: 2x
    assert timeline.static_memory == simulate(get("1f1b")(p=p, m=m), Costs(params=2.0)).static_memory


def test_dualpipe_directions_and_text_form():
    schedule = get("dualpipe")(p=4, m=8)
    assert schedule.chains == 2 and schedule.placement.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert {a.microbatch for a in schedule.ranks[0] if a.stage == 0} == {0, 1, 2, 3}
    assert {a.microbatch for a in schedule.ranks[0] if a.stage == 7} == {4, 5, 6, 7}
    assert "chains=2" in schedule.to_text().splitlines()[0]
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert Schedule.from_json(schedule.to_json()) == schedule
    program = lower_for(schedule, check=True)
    text = program.to_text()
    assert "3SEND_F" not in text and "4RECV_F" not in text  # the chains do not hand over
    assert Program.from_text(text, schedule) == program
    with pytest.raises(ScheduleError, match="two directions|2 directions"):
        to_torch_csv(schedule)


def test_dualpipe_validation_keeps_microbatches_in_their_chain():
    text = get("dualpipe")(p=2, m=4).to_text().replace("0F0 ", "0F3 ", 1)
    with pytest.raises(ScheduleError, match="chain 0 of 2, which runs microbatches 0..1"):
        check_structure(Schedule.from_text(text))


@pytest.mark.parametrize("p,m,says", [
    (3, 8, r"dualpipe needs an even p .* got p=3; use -p 2 or -p 4"),
    (4, 9, r"p=4 takes m = 8, 10, \.\.\.; got m=9; use -m 10"),
    (4, 6, r"got m=6; use -m 8"),
])
def test_dualpipe_bad_input_is_one_line(p, m, says):
    with pytest.raises(ScheduleError, match=says) as err:
        get("dualpipe")(p=p, m=m)
    assert "\n" not in str(err.value)


def test_hardware_overlap_share_prices_the_pairs():
    import dataclasses

    from pipeblocks.sim.analytic import HARDWARE, MODELS, transformer_costs

    schedule = get("dualpipev")(p=4, m=16)
    a100 = HARDWARE["a100"]
    assert a100.overlap == 0.0 and transformer_costs(MODELS["1.5b"], a100, num_stages=8).overlap == 0.0
    hiding = dataclasses.replace(a100, overlap=0.5)
    costs = transformer_costs(MODELS["1.5b"], hiding, num_stages=8)
    assert all(0 < x <= 0.5 * f for x, f in zip(costs.overlap, costs.t_f))
    plain = simulate(schedule, transformer_costs(MODELS["1.5b"], a100, num_stages=8))
    assert simulate(schedule, costs).makespan < plain.makespan
    with pytest.raises(ScheduleError, match="overlap is a share 0..1"):
        dataclasses.replace(a100, overlap=1.5)


def test_dualpipe_model_costs_price_whole_model_stages_twice():
    from pipeblocks.core.cost.costs import repeat_stages
    from pipeblocks.sim.analytic import HARDWARE, MODELS, transformer_costs

    model = transformer_costs(MODELS["1.5b"], HARDWARE["a100"], num_stages=4)
    costs = repeat_stages(model, 2)
    assert costs.t_f == model.t_f * 2 and costs.params == model.params * 2
    table = costs.for_schedule(get("dualpipe")(p=4, m=8))
    assert table.f[5] == model.t_f[1] and table.b[4] == model.t_b[0]  # stage 4 copies stage 0: no input grad


def test_plan_refuses_dualpipe_and_takes_dualpipev():
    from pipeblocks.plan.space import PlanProblem
    from pipeblocks.sim.analytic import HARDWARE, MODELS

    common = dict(model=MODELS["1.5b"], hardware=HARDWARE["a100"], gpus=8, gpu_memory=80e9, global_batch=16)
    with pytest.raises(ValueError, match="does not price DualPipe's copies"):
        PlanProblem(schedules=("dualpipe",), **common)
    assert PlanProblem(schedules=("dualpipev",), **common).schedules == ("dualpipev",)
