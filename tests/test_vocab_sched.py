"""Vocabulary parallelism in the IR: the passes' text form, their generic insertion into
schedules, the check, the deadlock check with the collectives, and the simulator's time
and memory of them."""
from __future__ import annotations

import dataclasses

import pytest

from pipeblocks import schedules
from pipeblocks.core.cost.costs import Costs
from pipeblocks.core.ir.errors import DeadlockError, ScheduleError
from pipeblocks.core.lowering.lower import check_deadlock
from pipeblocks.core.lowering.entry import lower_for
from pipeblocks.core.ir.ops import parse_op
from pipeblocks.core.ir.program import Program
from pipeblocks.core.simulator.simulate import simulate, simulate_program
from pipeblocks.core.ir.vocab import VocabCosts, VocabPass, check_vocab
from pipeblocks.core.lowering.vocab_place import one_more_in_flight

VOCAB = VocabCosts(t_s=0.3, t_t=0.2, t_if=0.05, t_ib=0.05, t_bcast=0.05, t_c0=0.1, t_if_reduce=0.02,
                   t_ib_bcast=0.02, mem_st=0.5, params=0.25)
COSTS = Costs(t_f=1.0, t_b=1.0, t_w=1.0, vocab=VOCAB)


def _lowered(name: str, p: int, m: int, costs: Costs = COSTS) -> Program:
    return lower_for(schedules.get(name)(p=p, m=m), vocab=costs, check=True, simulate=simulate_program)


def test_text_form_round_trips():
    program = _lowered("1f1b", 2, 3)
    assert Program.from_text(program.to_text(), program.schedule) == program
    assert parse_op("IB7", schedules.get("1f1b")(p=2, m=8)) == VocabPass("IB", 7)
    with pytest.raises(ScheduleError, match="microbatch 9 is out of range for m=3"):
        parse_op("S9", program.schedule)


@pytest.mark.parametrize("name,p,m", [
    ("1f1b", 2, 3), ("1f1b", 4, 8), ("v-half", 2, 4), ("v-half", 4, 8), ("zb-v", 2, 4), ("zb-v", 4, 8),
    ("interleaved-1f1b", 2, 4), ("gpipe", 3, 3), ("zb-h1", 3, 6), ("v-min", 4, 8),
])
def test_every_rank_runs_each_pass_once_in_one_order(name, p, m):
    program = _lowered(name, p, m)
    check_vocab(program)  # one IF, S, T, IB per microbatch, one order on every rank, roots in place
    check_deadlock(program)
    sequences = {tuple(op for op in ops if type(op) is VocabPass) for ops in program.ranks}
    assert len(sequences) == 1 and len(next(iter(sequences))) == 4 * m
    # the compute actions are the schedule's own (the schedule may hold one more microbatch in flight)
    actions = [[op for op in ops if type(op).__name__ == "Action"] for ops in program.ranks]
    assert [sorted(map(str, a)) for a in actions] == [sorted(map(str, r)) for r in program.schedule.ranks]


def test_one_more_in_flight_gives_1f1b_p_plus_one():
    s = schedules.get("1f1b")(p=4, m=8)
    shifted = one_more_in_flight(s)
    warmup = [next(k for k, a in enumerate(acts) if a.kind.value != "F") for acts in shifted.ranks]
    assert warmup == [5, 4, 3, 2]  # p - r + 1 forwards before the first backward (1F1B: p - r)
    assert simulate(shifted).peak_activation == (5.0, 4.0, 3.0, 2.0)
    program = _lowered("1f1b", 4, 8, dataclasses.replace(COSTS, vocab=dataclasses.replace(VOCAB, mem_st=0.0)))
    # at these costs the shifted schedule is faster, and is the one kept: p + 1 on rank 0
    assert simulate_program(program, COSTS).peak_activation[0] >= 5.0


def test_check_names_the_misplaced_pass():
    program = _lowered("1f1b", 2, 3)
    ranks = [list(ops) for ops in program.ranks]
    r1 = ranks[1]
    i, j = r1.index(VocabPass("S", 0)), r1.index(VocabPass("IF", 1))
    r1[i], r1[j] = r1[j], r1[i]
    with pytest.raises(ScheduleError, match="rank 1 runs vocabulary pass .* same order"):
        check_vocab(Program(program.schedule, tuple(map(tuple, ranks))))
    ranks = [list(ops) for ops in program.ranks]
    ranks[0].remove(VocabPass("T", 2))
    with pytest.raises(ScheduleError, match="rank 0 holds 11 vocabulary passes.*missing T2"):
        check_vocab(Program(program.schedule, tuple(map(tuple, ranks))))


def test_a_pass_before_its_input_deadlocks():
    program = _lowered("1f1b", 2, 3)
    ranks = [list(ops) for ops in program.ranks]
    # rank 0 runs S0 and T0 before it sends microbatch 0 forward: the last stage never runs 1F0
    for kind in ("T", "S"):
        ranks[0].remove(VocabPass(kind, 0))
    first = next(k for k, op in enumerate(ranks[0]) if type(op).__name__ == "Action")
    ranks[0][first:first] = [VocabPass("S", 0), VocabPass("T", 0)]
    seq0 = [op for op in ranks[0] if type(op) is VocabPass]
    for r in (1,):  # keep one order: rank 1 gets the same sequence at its own positions
        positions = [k for k, op in enumerate(ranks[r]) if type(op) is VocabPass]
        for k, op in zip(positions, seq0):
            ranks[r][k] = op
    with pytest.raises(DeadlockError, match="X of the last stage of microbatch 0"):
        check_deadlock(Program(program.schedule, tuple(map(tuple, ranks))))


def test_simulated_time_and_memory_of_the_passes():
    s = schedules.get("gpipe")(p=2, m=2)
    plain = simulate(s, dataclasses.replace(COSTS, vocab=None))
    timeline = simulate(s, COSTS)
    busy = [sum(e.end - e.start for e in evs) for evs in timeline.events]
    per_mb = VOCAB.t_s + VOCAB.t_t + VOCAB.t_if + VOCAB.t_ib
    assert busy == pytest.approx([b + 2 * per_mb for b in (sum(e.end - e.start for e in evs) for evs in plain.events)])
    # S holds mem_st until T on every rank
    assert all(peak > base for peak, base in zip(timeline.peak_activation, plain.peak_activation))
    assert max(timeline.peak_activation[r] - plain.peak_activation[r] for r in range(2)) <= 2 * VOCAB.mem_st
    # each rank holds its vocabulary rows' parameters
    extra = [a - b for a, b in zip(timeline.static_memory, plain.static_memory)]
    assert extra[0] == pytest.approx(extra[1]) and extra[0] > 0
    # T waits for C0, which waits for the slowest rank's S
    for evs in timeline.events:
        t0 = next(e for e in evs if e.action == VocabPass("T", 0))
        assert t0.start >= max(e.end for r in timeline.events for e in r if e.action == VocabPass("S", 0)) + VOCAB.t_c0 - 1e-12


def test_sequence_chunks_are_refused():
    s = schedules.get("seq1f1b")(p=2, m=2, seq_chunks=2)
    with pytest.raises(ScheduleError, match="sequence chunks"):
        simulate(s, COSTS)


def test_text_timeline_shows_the_passes():
    from pipeblocks.sim.text_timeline import render_text_timeline

    text = render_text_timeline(simulate(schedules.get("gpipe")(p=2, m=2), COSTS))
    assert all(label in text for label in ("IF0", "S1", "T0", "IB1"))


def test_module_docstring_shows_the_lowered_program():
    from pipeblocks.core.ir import vocab

    text = _lowered("1f1b", 2, 2).to_text()
    assert all(f"    {line}" in vocab.__doc__ for line in text.splitlines())


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_two_barriers_put_t_before_the_last_backward(name):
    costs = dataclasses.replace(COSTS, vocab=dataclasses.replace(VOCAB, barriers=2, t_c1=0.1))
    program = _lowered(name, 2, 4, costs)
    check_vocab(program, barriers=2)
    check_deadlock(program)
    last = program.schedule.num_stages - 1
    root = program.ranks[program.schedule.placement.stage_to_rank[last]]
    for i in range(4):
        t = root.index(VocabPass("T", i))
        b = next(k for k, op in enumerate(root) if type(op).__name__ == "Action" and op.stage == last
                 and op.microbatch == i and op.kind.value in ("B", "BW"))
        assert t < b
    # with one barrier T may follow that backward; checked as two barriers it is refused
    one = _lowered(name, 2, 4)
    if any(r.index(VocabPass("T", 0)) > r.index(next(op for op in r if type(op).__name__ == "Action"
                                                     and op.stage == last and op.microbatch == 0
                                                     and op.kind.value in ("B", "BW")))
           for r in (one.ranks[one.schedule.placement.stage_to_rank[last]],)):
        with pytest.raises(ScheduleError, match="T0 runs after"):
            check_vocab(one, barriers=2)


@pytest.mark.parametrize("name,p,m", [("1f1b", 4, 4), ("zb-h1", 3, 6), ("v-half", 4, 8), ("interleaved-1f1b", 2, 4)])
def test_collectives_slower_than_the_passes_still_place(name, p, m):
    # a tiny model on a real link: X arrives long after the last stage's backward would have
    # run, so the rank's S must still go before whatever follows that backward
    slow = dataclasses.replace(VOCAB, t_bcast=30.0, t_c0=50.0, t_if_reduce=20.0, t_ib_bcast=30.0)
    program = _lowered(name, p, m, dataclasses.replace(COSTS, t_f=0.01, t_b=0.01, t_w=0.01, vocab=slow))
    check_vocab(program)
    check_deadlock(program)


def test_data_parallel_reduces_the_vocabulary_rows_at_the_step_end():
    from pipeblocks.core.cost.dp_model import DPCostModel

    s = schedules.get("1f1b")(p=2, m=2)
    timeline = simulate(s, dataclasses.replace(COSTS, data_parallel=DPCostModel(dp=2)))
    for r, comm in enumerate(timeline.comm_events):
        reduce = [e for e in comm if e.op == "VOCAB_REDUCE_GRAD"]
        assert len(reduce) == 1 and reduce[0].end > reduce[0].start
        assert reduce[0].start >= max(e.end for e in timeline.events[r]) - 1e-12  # after the last T and IB
    rowless = simulate(s, dataclasses.replace(COSTS, data_parallel=DPCostModel(dp=2),
                                              vocab=dataclasses.replace(VOCAB, params=0.0)))
    assert not any(e.op == "VOCAB_REDUCE_GRAD" for comm in rowless.comm_events for e in comm)


def test_vocabulary_rows_stay_replicated_under_per_stage_sharding():
    # the runtime keeps the rows whole on every replica and averages their gradients, so
    # they are priced as replicated whatever the stages' policies, one per stage included
    from pipeblocks.core.cost.dp_model import DPCostModel, static_bytes
    from pipeblocks.core.ir.sharding import ShardingPolicy

    s = schedules.get("1f1b")(p=2, m=2)
    base = dataclasses.replace(COSTS, data_parallel=DPCostModel(dp=2, sharding=("zero3", "zero1")))
    rows = simulate(s, base)
    rowless = simulate(s, dataclasses.replace(base, vocab=dataclasses.replace(VOCAB, params=0.0)))
    replicated = static_bytes(VOCAB.params, ShardingPolicy.REPLICATE, 2, base.data_parallel.bytes)
    for with_rows, without in zip(rows.static_memory, rowless.static_memory):
        assert with_rows - without == pytest.approx(replicated)
