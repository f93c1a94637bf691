"""Asynchronous 1F1B: the optimizer-step op, its placement and check, weight versions and
delays against the closed form, and the simulated steady state."""
from __future__ import annotations

import json

import pytest

from pipeblocks.core import (
    Costs, DeadlockError, OptimizerStep, Program, ScheduleError, WeightVersions, add_optimizer_steps,
    check_optimizer_steps, check_program, lower, simulate, simulate_program, stashed_versions, steady_state,
    weight_versions,
)
from pipeblocks.core.ir.actions import Action, Kind
from pipeblocks.core.ir.ops import ACTION, P2P, STEP, Stream, UnknownOpError, op_type, parse_op, require_known
from pipeblocks.cli.main import main
from pipeblocks.schedules import get
from pipeblocks.schedules.asynchronous import async_1f1b, async_1f1b_schedule, one_f_one_b_delay
from pipeblocks.sim.plots import plot_timeline
from pipeblocks.sim.text_timeline import render_text_timeline


def compute_ops(program: Program, rank: int) -> list[str]:
    return [str(op) for op in program.ranks[rank] if op_type(op).stream is Stream.COMPUTE]


# ---- the op --------------------------------------------------------------------------
def test_step_op_text_form_round_trips_through_the_table():
    program = async_1f1b(p=3, n=2, steps=3)
    schedule = program.schedule
    assert parse_op("2STEP1", schedule) == OptimizerStep(2, 1)
    assert str(OptimizerStep(2, 1)) == "2STEP1"
    assert op_type(OptimizerStep(0, 0)) is STEP and STEP.stream is Stream.COMPUTE
    assert Program.from_text(program.to_text(), schedule) == program
    with pytest.raises(ScheduleError, match="stage 3 does not exist"):
        parse_op("3STEP0", schedule)


def test_a_consumer_without_steps_names_the_step_op():
    program = async_1f1b(p=2, n=1, steps=2)
    # what the runtime checks before it runs a rank's ops: it does not run steps yet
    with pytest.raises(UnknownOpError, match=r"the runtime \(rank 1\) cannot run op 1STEP0 \(type optimizer step\)"):
        require_known(program.ranks[1], "the runtime (rank 1)", (ACTION, P2P))


def test_export_to_torch_refuses_optimizer_steps():
    from pipeblocks.interop.torch_comms import program_to_torch_csv

    with pytest.raises(ScheduleError, match="rank 0 holds optimizer step 0STEP0: torch.distributed.pipelining has no"):
        program_to_torch_csv(async_1f1b(p=2, n=1, steps=2))


def test_async_1f1b_is_1f1b_without_flush_and_a_step_after_every_n_backwards():
    program = async_1f1b(p=3, n=2, steps=3)
    assert program.schedule.m == 6 and program.schedule.name == "async-1f1b"
    assert compute_ops(program, 0) == (
        "0F0 0F1 0F2 0BW0 0F3 0BW1 0STEP0 0F4 0BW2 0F5 0BW3 0STEP1 0BW4 0BW5 0STEP2".split()
    )
    assert compute_ops(program, 2) == (
        "2F0 2BW0 2F1 2BW1 2STEP0 2F2 2BW2 2F3 2BW3 2STEP1 2F4 2BW4 2F5 2BW5 2STEP2".split()
    )
    # the step follows the backward's send, so the gradient leaves before the weights change
    ops = [str(op) for op in program.ranks[1]]
    assert ops[ops.index("1BW1") + 1:ops.index("1BW1") + 3] == ["1SEND_B1", "1STEP0"]
    assert async_1f1b_schedule(p=3, n=2, steps=3).ranks == get("1f1b")(p=3, m=6).ranks


@pytest.mark.parametrize("p,n,steps", [(1, 1, 1), (2, 1, 4), (4, 3, 3), (4, 8, 2), (5, 2, 7)])
def test_async_programs_validate(p, n, steps):
    program = async_1f1b(p=p, n=n, steps=steps)
    assert check_optimizer_steps(program) == n
    check_program(program)
    for rank in range(p):
        assert [str(op) for op in program.ranks[rank] if type(op) is OptimizerStep] == [
            f"{rank}STEP{k}" for k in range(steps)
        ]


def test_bad_sizes_are_errors():
    with pytest.raises(ScheduleError, match="steps must be an integer >= 1, got 0"):
        async_1f1b(p=2, n=2, steps=0)
    with pytest.raises(ScheduleError, match="microbatches per optimizer step must be an integer >= 1"):
        add_optimizer_steps(0)
    with pytest.raises(ScheduleError, match="m=5 microbatches, not a whole number of steps of 2"):
        lower(get("1f1b")(p=2, m=5), (add_optimizer_steps(2),))


def _move(program: Program, rank: int, op: str, before: str) -> Program:
    """`program` with op `op` on `rank` moved to just before op `before`."""
    ops = list(program.ranks[rank])
    texts = [str(o) for o in ops]
    moved = ops.pop(texts.index(op))
    texts.remove(op)
    ops.insert(texts.index(before), moved)
    ranks = list(program.ranks)
    ranks[rank] = tuple(ops)
    return Program(program.schedule, tuple(ranks))


def test_step_check_names_a_step_before_its_backwards():
    program = async_1f1b(p=2, n=2, steps=2)
    early = _move(program, 0, "0STEP0", "0BW1")
    with pytest.raises(ScheduleError, match=r"0BW1\) runs after 0STEP0, the step that consumes its gradient"):
        check_program(early)


def test_step_check_names_a_backward_of_the_next_step_before_the_step():
    program = async_1f1b(p=2, n=2, steps=2)
    late = _move(program, 1, "1STEP0", "1F3")
    with pytest.raises(ScheduleError, match=r"1BW2\) runs before 1STEP0, so its gradient would join step 0"):
        check_program(late)


def test_step_check_names_steps_out_of_order_and_uneven_counts():
    program = async_1f1b(p=2, n=1, steps=3)
    swapped = _move(program, 0, "0STEP1", "0STEP0")
    with pytest.raises(ScheduleError, match="stage 0 expects step 0 next"):
        check_program(swapped)
    ranks = list(program.ranks)
    ranks[1] = tuple(op for op in ranks[1] if str(op) != "1STEP2")
    with pytest.raises(ScheduleError, match=r"different numbers of optimizer steps \[3, 2\]"):
        check_program(Program(program.schedule, tuple(ranks)))


def test_deadlock_check_covers_programs_with_steps():
    program = async_1f1b(p=2, n=1, steps=3)
    # rank 0 waits for the gradient of microbatch 0 before it sends that microbatch on
    stuck = _move(program, 0, "0RECV_B0", "0SEND_F0")
    with pytest.raises(DeadlockError, match="rank 0 blocks at 0RECV_B0"):
        check_program(stuck)


# ---- versions and delays -------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_delays_match_the_closed_form(p, n):
    steps = 2 + (p + n) // n
    versions = weight_versions(async_1f1b(p=p, n=n, steps=steps))
    assert versions.step_size == n and versions.steps == steps
    for s in range(p):
        w = p - 1 - s
        for m in range(n * steps):
            assert versions.delay(s, m) == one_f_one_b_delay(p=p, n=n, stage=s, microbatch=m)
            if m >= w:  # steady state: floor(m/N) - floor((m - W_s)/N)
                assert versions.delay(s, m) == m // n - (m - w) // n
            assert versions.backward[s][m] == m // n  # a backward sees every earlier step of its stage


def steady_delay_sets(p: int, n: int) -> list[set[int]]:
    versions = weight_versions(async_1f1b(p=p, n=n, steps=4 + 2 * p // n))
    return [set(versions.delays(s)[p - 1 - s:]) for s in range(p)]


def test_delay_table_p8():
    assert steady_delay_sets(8, 1) == [{7}, {6}, {5}, {4}, {3}, {2}, {1}, {0}]
    assert steady_delay_sets(8, 2) == [{3, 4}, {3}, {2, 3}, {2}, {1, 2}, {1}, {0, 1}, {0}]
    assert steady_delay_sets(8, 8) == [{0, 1}] * 7 + [{0}]


@pytest.mark.parametrize("p,n", [(8, 1), (8, 2), (8, 8), (4, 3), (5, 2)])
def test_weight_stashing_keeps_max_delay_plus_one_versions(p, n):
    program = async_1f1b(p=p, n=n, steps=4 + 2 * p // n)
    versions = weight_versions(program)
    assert stashed_versions(program) == tuple(versions.max_delay(s) + 1 for s in range(p))
    if n == 1:
        assert stashed_versions(program) == tuple(p - s for s in range(p))


def test_a_stash_outlives_the_step_after_its_forward():
    # 8 microbatches through 8 stages: stage 0 runs all its forwards at version 0, then steps
    # while they are still in flight, so it holds version 0 beside the current one
    assert stashed_versions(async_1f1b(p=8, n=1, steps=8)) == (2, 3, 4, 5, 4, 3, 2, 1)


def test_versions_of_a_synchronous_program_are_all_zero():
    versions = weight_versions(lower(get("1f1b")(p=3, m=4)))
    assert versions == WeightVersions.synchronous(3, 4, 1)
    assert all(versions.delays(s) == (0,) * 4 for s in range(3))
    assert stashed_versions(lower(get("1f1b")(p=3, m=4))) == (1, 1, 1)


def test_versions_append_after_a_synchronous_warm_up():
    run = WeightVersions.synchronous(2, 2, 2).then(weight_versions(async_1f1b(p=2, n=2, steps=2)))
    assert run.steps == 4
    assert run.forward[0] == (0, 0, 1, 1, 2, 2, 2, 3)
    assert run.backward[0] == (0, 0, 1, 1, 2, 2, 3, 3)
    assert run.delays(0) == (0, 0, 0, 0, 0, 0, 1, 0)
    assert run.step_delay(0, 3) == 1 and run.max_delay(1) == 0
    with pytest.raises(ValueError, match="must match"):
        run.then(WeightVersions.synchronous(2, 1, 2))


def test_versions_reject_impossible_tables():
    with pytest.raises(ValueError, match="0 <= forward <= backward <= its step 0"):
        WeightVersions(2, ((0, 1),), ((0, 1),))


# ---- simulation ----------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (3, 5)])
def test_async_steady_state_has_no_bubble_where_1f1b_pays_its_flush(p, m):
    sync = simulate(get("1f1b")(p=p, m=m))
    assert sync.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    timeline = simulate_program(async_1f1b(p=p, n=m, steps=5))
    steady = steady_state(timeline)
    assert steady.steps_measured == 3 and steady.step_size == m
    assert steady.bubble == pytest.approx(0.0, abs=1e-12)
    assert steady.step_time == pytest.approx(3 * m)  # F + fused BW = 3 per microbatch
    assert steady.throughput == pytest.approx(1 / 3)
    assert m / sync.makespan < steady.throughput  # what the flush costs


def test_step_cost_occupies_the_compute_stream():
    timeline = simulate_program(async_1f1b(p=3, n=2, steps=4), Costs(t_step=0.5))
    steps = [e for e in timeline.events[0] if type(e.action) is OptimizerStep]
    assert [e.end - e.start for e in steps] == [0.5] * 4
    steady = steady_state(timeline)
    assert steady.step_time == pytest.approx(6.5)
    assert steady.busy_per_step == pytest.approx(6.5)  # a step is work, not bubble
    assert "S1" in render_text_timeline(timeline)


def test_text_timeline_draws_a_step_that_ends_the_run():
    # with zero-length optimizer steps the last one starts at the makespan, in the half cell
    # that rounds past the last: it is drawn in the last cell, for every p, N and run length
    for p, n, steps in ((2, 1, 1), (3, 2, 2), (3, 2, 4), (5, 3, 3)):
        text = render_text_timeline(simulate_program(async_1f1b(p=p, n=n, steps=steps)))
        rows = text.splitlines()[1:]
        assert len(rows) == p and f"S{steps - 1}" in rows[0].split()[-1]


def test_steady_state_needs_an_asynchronous_run_of_three_steps():
    with pytest.raises(ValueError, match="no optimizer steps"):
        steady_state(simulate(get("1f1b")(p=2, m=4)))
    with pytest.raises(ValueError, match="has 2 optimizer steps"):
        steady_state(simulate_program(async_1f1b(p=2, n=2, steps=2)))


def test_plot_shows_an_asynchronous_timeline(tmp_path):
    timeline = simulate_program(async_1f1b(p=2, n=2, steps=3), Costs(t_step=0.25))
    assert plot_timeline(timeline, tmp_path / "async.png").stat().st_size > 0


def test_unit_costs_default_step_cost_is_zero():
    timeline = simulate_program(async_1f1b(p=2, n=1, steps=3))
    assert all(e.end == e.start for evs in timeline.events for e in evs if type(e.action) is OptimizerStep)
    assert Action(0, Kind.F, 0) == timeline.events[0][0].action


def test_simulate_async_reports_steady_state_delays_and_weight_memory(capsys):
    assert main(["simulate", "1f1b", "-p", "4", "-m", "2", "--async", "pipedream", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steady_bubble"] == 0 and data["sync_bubble_ratio"] == pytest.approx(3 / 5)
    assert data["step_time"] == 6 and data["speedup"] == pytest.approx(2.5)
    assert data["max_delay"] == [2, 1, 1, 0]
    assert data["weight_memory"] == [3, 2, 2, 1] and data["weight_memory_sync"] == [1, 1, 1, 1]
    assert main(["simulate", "1f1b", "-p", "4", "-m", "8", "--async", "pipemare"]) == 0
    assert "bubble        0.0000 per step" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["zb-v", "--async", "naive"], "schedule 'zb-v' has no asynchronous form: --async runs with 1f1b"),
    (["1f1b", "--async", "naive", "--dp", "2"], "--async with --dp 2 is not supported yet"),
    (["1f1b", "--async", "naive", "--async-steps", "2"], "--async-steps 2: the steady state leaves out"),
    (["1f1b", "--async", "naive", "--seq-chunks", "2"], "--async with sequence chunks is not supported"),
])
def test_simulate_async_errors(capsys, argv, message):
    assert main(["simulate", *argv, "-p", "4", "-m", "4"]) == 2
    assert message in capsys.readouterr().err


def test_plot_draws_the_optimizer_steps_on_the_passes_time_scale():
    # a run drawn in ms (scale 1e-3): the black step marks sit where the steps are, as the passes do
    from pipeblocks.sim.plots import _draw_ranks

    class Axis:
        def __init__(self):
            self.bars, self.marks = [], []

        def broken_barh(self, spans, *args, **kwargs):
            self.bars.extend(spans)

        def vlines(self, x, *args, **kwargs):
            self.marks.append(x)

        def __getattr__(self, name):  # titles, labels, ticks, text: not drawn here
            return lambda *args, **kwargs: None

    timeline = simulate_program(async_1f1b(p=2, n=2, steps=3), Costs(t_step=0.25))
    steps = sorted(e.start - timeline.start for events in timeline.events for e in events
                   if type(e.action) is OptimizerStep)
    ax = Axis()
    _draw_ranks(ax, timeline, "async", scale=1e-3)
    assert sorted(ax.marks) == pytest.approx([t / 1e-3 for t in steps])
    assert max(start + length for start, length in ax.bars) == pytest.approx(timeline.makespan / 1e-3)
