"""RECOMPUTE: the op, its text form, the lowering pass, validation, simulated time and memory."""
from __future__ import annotations

import json

import pytest

from pipeblocks import schedules
from pipeblocks.cli.main import main
from pipeblocks.core.cost.costs import Costs
from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.core.lowering.lower import PASSES, check_deadlock, lower
from pipeblocks.core.ir.ops import Recompute, parse_op
from pipeblocks.core.ir.program import Program
from pipeblocks.core.lowering.recompute import add_recompute, all_pairs, check_recompute
from pipeblocks.core.simulator.simulate import simulate
from pipeblocks.resolve.recompute_auto import choose_recompute, memory_need

one_f_one_b = schedules.get("1f1b")


def test_text_form_round_trips():
    schedule = one_f_one_b(p=2, m=2)
    program = lower(schedule, PASSES + (add_recompute(all_pairs(schedule)),))
    text = program.to_text()
    assert text == (
        "0: 0F0 0SEND_F0 0F1 0SEND_F1 0R0 0RECV_B0 0BW0 0R1 0RECV_B1 0BW1\n"
        "1: 1RECV_F0 1F0 1R0 1BW0 1SEND_B0 1RECV_F1 1F1 1R1 1BW1 1SEND_B1\n"
    )
    assert Program.from_text(text, schedule) == program
    assert parse_op("3R4.1", schedules.get("seq1f1b")(p=4, m=8)) == Recompute(3, 4, 1)
    check_deadlock(program)
    check_recompute(program)


@pytest.mark.parametrize("text,message", [
    ("0: 0R0 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0BW0 0RECV_B1 0BW1\n", "before the forward"),
    ("0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0BW0 0R0 0RECV_B1 0BW1\n", "after the backward"),
    ("0: 0F0 0SEND_F0 0F1 0SEND_F1 0R0 0R0 0RECV_B0 0BW0 0RECV_B1 0BW1\n", "twice"),
    ("0: 0F0 0SEND_F0 0F1 0SEND_F1 1R0 0RECV_B0 0BW0 0RECV_B1 0BW1\n", "not on this rank"),
])
def test_misplaced_recompute_is_rejected(text, message):
    schedule = one_f_one_b(p=2, m=2)
    rank1 = "1: 1RECV_F0 1F0 1BW0 1SEND_B0 1RECV_F1 1F1 1BW1 1SEND_B1\n"
    with pytest.raises(ScheduleError, match=message):
        check_recompute(Program.from_text(text + rank1, schedule))


def test_pairs_outside_the_schedule_are_rejected():
    schedule = one_f_one_b(p=2, m=2)
    with pytest.raises(ScheduleError, match="outside the schedule"):
        simulate(schedule, recompute=[(0, 5)])


def test_time_and_memory_of_one_pair():
    costs = Costs(t_f=2.0, recompute_input_ratio=0.25)
    schedule = one_f_one_b(p=1, m=1)
    plain, recomputed = simulate(schedule, costs), simulate(schedule, costs, recompute=[(0, 0)])
    assert recomputed.makespan == plain.makespan + 2.0
    assert recomputed.recompute_time == (2.0,) and plain.recompute_time == (0.0,)
    # F keeps a quarter, R adds the rest back; both end at zero
    assert [held for _, held in recomputed.memory[0]] == [0.0, 0.25, 1.0, 0.0]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (3, 7)])
def test_1f1b_r_closed_form(p, m):
    ratio = 0.05
    timeline = simulate(schedules.get("1f1b-r")(p=p, m=m), Costs(recompute_input_ratio=ratio))
    expected = [min(m, p - r) * ratio + (1 - ratio) for r in range(p)]
    assert timeline.peak_activation == pytest.approx(expected)
    assert timeline.recompute_time == pytest.approx([float(m)] * p)  # one forward per microbatch
    assert timeline.makespan > simulate(one_f_one_b(p=p, m=m)).makespan


def test_auto_fits_the_budget_with_fewer_pairs_than_all():
    schedule = one_f_one_b(p=4, m=8)
    costs = Costs()
    budget = 16 + 2.5  # static (16 per stage in fp32 AdamW) plus 2.5 stage activations
    pairs = choose_recompute(schedule, costs, budget)
    assert 0 < len(pairs) < len(all_pairs(schedule))
    assert max(memory_need(simulate(schedule, costs, recompute=pairs))) <= budget
    assert max(memory_need(simulate(schedule, costs))) > budget
    assert choose_recompute(schedule, costs, 16 + 5) == frozenset()


def test_auto_too_small_says_the_smallest():
    with pytest.raises(ScheduleError, match=r"at least 17\.15"):
        choose_recompute(one_f_one_b(p=4, m=8), Costs(), 17.0)


def test_cli_json(capsys):
    assert main(["simulate", "1f1b", "-p", "2", "-m", "4", "--recompute", "all", "--gpu-memory", "17.2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recompute_time"] == [4.0, 4.0] and data["fits_memory"] is True
    assert main(["simulate", "1f1b", "-p", "2", "-m", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recompute_time"] == [0.0, 0.0] and data["fits_memory"] is None


def test_show_and_plot_draw_recomputation(capsys, tmp_path):
    assert main(["show", "1f1b-r", "-p", "2", "-m", "2"]) == 0
    out = capsys.readouterr().out
    assert "R recompute" in out and "R0" in out.splitlines()[1]
    assert main(["show", "1f1b-r", "-p", "2", "-m", "2", "--program"]) == 0
    assert "0R0 0RECV_B0 0BW0" in capsys.readouterr().out
    assert main(["plot", "1f1b", "-p", "2", "-m", "2", "--recompute", "all", "-o", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").stat().st_size > 0


def test_analytic_input_share():
    from pipeblocks.sim.analytic import HARDWARE, parse_model, transformer_costs

    config = parse_model("6.2b")
    costs = transformer_costs(config, HARDWARE["cloud"], num_stages=4)
    hidden_state = config.seq * config.microbatch_size * config.hidden * config.dtype_bytes
    assert costs.recompute_input_ratio == pytest.approx(tuple(hidden_state / m for m in costs.mem_b))
    assert all(0 < r < 0.05 for r in costs.recompute_input_ratio)


def test_bad_recompute_mode():
    from pipeblocks.resolve.request import Mesh, ScheduleRequest

    with pytest.raises(ValueError, match="--recompute 'some'"):
        ScheduleRequest(name="1f1b", m=4, mesh=Mesh(pp=2), recompute="some")


def test_zero3_recomputation_runs_gathered():
    """A recomputation runs the stage's forward, so a zero3 stage must be gathered for it:
    the DP passes place it inside the UNSHARD..RESHARD window, and a misplaced one is refused."""
    from pipeblocks.core.lowering.passes_dp import check_dp_ops, dp_passes
    from pipeblocks.core.ir.sharding import ShardingPolicy

    zero3 = (ShardingPolicy.ZERO3,)
    schedule = schedules.get("elastic")(p=2, m=4, forward_groups="2,2", backward_groups="4")
    program = lower(schedule, PASSES + dp_passes(zero3, 2) + (add_recompute(all_pairs(schedule)),))
    check_dp_ops(program, zero3)
    check_recompute(program)
    single = one_f_one_b(p=1, m=1)
    good = "0: 0UNSHARD 0F0 0R0 0BW0 0REDUCE_GRAD 0RESHARD\n"
    check_dp_ops(Program.from_text(good, single), zero3)
    bad = "0: 0UNSHARD 0F0 0RESHARD 0R0 0UNSHARD 0BW0 0REDUCE_GRAD 0RESHARD\n"
    with pytest.raises(ScheduleError, match="sharded here; put 0UNSHARD before it"):
        check_dp_ops(Program.from_text(bad, single), zero3)
