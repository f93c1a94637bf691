"""The planner prices vocabulary parallelism (`plan --vocab-parallel`) and ranks it beside the plain schedules."""
from __future__ import annotations

import math

import pytest

from pipeblocks.plan.report import commands
from pipeblocks.plan.search import PlanResult, _Entry, evaluate, search
from pipeblocks.plan.space import MeshShape, PlanProblem
from pipeblocks.sim.analytic import HARDWARE, MODELS
from pipeblocks.sim.memory_estimate import stage_param_shapes
from pipeblocks.sim.vocab_memory import vocab_rank_static_peak, vocab_stage_param_shapes

LLAMA = MODELS["llama-3-8b"]


def _problem(**kw) -> PlanProblem:
    base = dict(model=LLAMA, hardware=HARDWARE["a100"], gpus=8, gpu_memory=80e9, global_batch=32,
                schedules=("1f1b",), microbatch_sizes=(1,), tp_degrees=(1,), vocab_parallel=True)
    return PlanProblem(**{**base, **kw})


def test_parameters_are_moved_not_lost():
    p = 8
    plain = sum(math.prod(s) for stage in stage_param_shapes(LLAMA, p) for s in stage)
    split = sum(math.prod(s) for stage in vocab_stage_param_shapes(LLAMA, p) for s in stage)
    assert plain - split == 2 * LLAMA.vocab * LLAMA.hidden
    # each rank's rows: ceil(V/p) of each table, in bytes at replicate under bf16-mixed (18 per parameter)
    one = vocab_rank_static_peak(LLAMA, p, [3], "replicate", dp=1, precision="bf16-mixed", ranks=p)
    middle = sum(math.prod(s) for s in vocab_stage_param_shapes(LLAMA, p)[3])
    assert one == 18 * (middle + 2 * 16032 * LLAMA.hidden)


def test_vocab_parallel_beats_the_plain_pipeline_at_p8_and_balances_it():
    problem = _problem()
    entry = _Entry(bound=1.0, shape=MeshShape(1, 1, 8), microbatch_size=1, m=32, stages=8)
    (plain,), _, _ = evaluate(problem, "1f1b", 1, entry)
    (vocab,), _, _ = evaluate(problem, "1f1b", 1, entry, vocab=True)
    assert vocab.candidate.vocab_parallel and vocab.candidate.label == "1f1b+vocab"
    assert vocab.iteration_time < plain.iteration_time
    static_plain = [s for s, _ in plain.rank_memory]
    static_vocab = [s for s, _ in vocab.rank_memory]
    assert max(static_plain) / min(static_plain) > 1.3   # the end stages hold a 128k x 4096 table each
    assert max(static_vocab) / min(static_vocab) < 1.01  # every rank holds 1/8 of both
    assert math.isclose(sum(static_vocab), sum(static_plain), rel_tol=1e-9)  # 8 divides V: moved, not padded


def test_search_lists_both_and_the_command_names_the_option():
    result: PlanResult = search(_problem(global_batch=16, gpus=4, gpu_memory=200e9, seq_chunks=()), jobs=1)
    labels = {e.candidate.label for e in result.evaluated}
    assert {"1f1b", "1f1b+vocab"} <= labels
    best = next(e for e in result.ranked if e.candidate.vocab_parallel)
    one = PlanResult(result.problem, (best,), (), 0.0, 0)
    assert "--vocab-parallel" in commands(one)[0]
    assert all("--vocab-parallel" not in c for c in commands(PlanResult(
        result.problem, tuple(e for e in result.evaluated if not e.candidate.vocab_parallel), (), 0.0, 0)))
    # train runs a +vocab plan of the built-in Llama with replicas, not yet with --tp: the plan
    # names the best plan it runs beside a best it does not
    from pipeblocks.plan.report import TRAIN_RUNS_VOCAB_PARALLEL, runnable, to_json, trains
    assert TRAIN_RUNS_VOCAB_PARALLEL
    vocab = [e for e in result.ranked if e.candidate.vocab_parallel]
    assert any(e.candidate.dp > 1 for e in vocab)
    assert all(trains(result, e) == (e.candidate.tp == 1 and e.candidate.seq_chunks == 1) for e in vocab)
    assert runnable(one) is (best if trains(result, best) else None)
    first = next(e for e in result.ranked if trains(result, e))
    assert runnable(result) is first
    assert to_json(result)["train_commands"] == commands(result, first)
    # a pipeline of one rank has no vocabulary to split: skipped, with the reason
    assert any(s.shape.pp == 1 and "vocabulary" in s.reason for s in result.skipped)


def test_planner_static_memory_is_the_simulators():
    """The planner's static bytes per rank (tensor shapes) equal what `simulate --vocab-parallel`
    holds in the step (parameter counts), rank by rank, at bf16-mixed and replicate."""
    from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
    from pipeblocks.resolve.build import build

    p = 4
    costs = CostSpec(model="llama-3-8b", hardware="a100", vocab_parallel=True, mixed_precision=True)
    timeline = build(ScheduleRequest("1f1b", m=p, mesh=Mesh(pp=p), costs=costs)).simulate()
    planner = [vocab_rank_static_peak(LLAMA, p, [r], "replicate", dp=1, precision="bf16-mixed", ranks=p)
               for r in range(p)]
    for r in range(p):
        assert math.isclose(timeline.static_memory_peak[r], planner[r], rel_tol=1e-6), r


def test_planner_step_and_memory_are_what_simulate_reports(capsys):
    """Without the intensity model a +vocab candidate's step and peak per GPU are those
    `simulate --vocab-parallel --mixed-precision` prints for the same configuration."""
    import json

    from pipeblocks.cli.main import main

    problem = _problem(gpus=4, global_batch=8, intensity=False, seq_chunks=(), gpu_memory=200e9)
    entry = _Entry(bound=1.0, shape=MeshShape(1, 1, 4), microbatch_size=1, m=8, stages=4)
    (done,), _, _ = evaluate(problem, "1f1b", 1, entry, vocab=True)
    assert main(["simulate", "1f1b", "-p", "4", "-m", "8", "--model", "llama-3-8b", "--hardware", "a100",
                 "--vocab-parallel", "--mixed-precision", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    need = max(s + a for s, a in zip(summary["static_memory_peak"], summary["peak_activation"]))
    assert done.peak_memory == pytest.approx(need, rel=1e-9)
    assert done.iteration_time == pytest.approx(summary["makespan"], rel=1e-9)


def test_split_auto_balances_a_vocab_candidate_per_rank():
    """--split auto balances the head and embedding against layers; a +vocab candidate has them on
    no stage, so its layers are balanced per rank (a split balanced for the head would now starve
    the last stage, and the even rule's lighter ends starve rank 0 under a V placement)."""
    from pipeblocks.core.cost.split import rank_balanced

    entry = _Entry(bound=1.0, shape=MeshShape(1, 1, 4), microbatch_size=1, m=8, stages=4)
    auto, even = _problem(split="auto", gpu_memory=200e9), _problem(gpu_memory=200e9)
    assert auto.stage_split(4) != (8, 8, 8, 8) and auto.stage_split(4, vocab=True) == (8, 8, 8, 8)
    (a,), _, _ = evaluate(auto, "1f1b", 1, entry, vocab=True)
    (b,), _, _ = evaluate(even, "1f1b", 1, entry, vocab=True)
    assert a.iteration_time == b.iteration_time and a.rank_memory == b.rank_memory
    for layers, p in ((28, 4), (30, 4), (29, 3)):
        counts = rank_balanced(layers, 2 * p)
        v_ranks = [counts[r] + counts[2 * p - 1 - r] for r in range(p)]
        loop_ranks = [counts[r] + counts[r + p] for r in range(p)]
        assert sum(counts) == layers and max(v_ranks) - min(v_ranks) <= 1 and max(loop_ranks) - min(loop_ranks) <= 1


def test_a_vocabulary_too_small_for_pp_skips_only_those_candidates():
    from pipeblocks.sim.analytic import parse_model

    problem = _problem(model=parse_model("4,64,4,16,5"), gpus=4, global_batch=4, gpu_memory=80e9, seq_chunks=())
    result = search(problem, jobs=1)
    assert any(s.shape.pp == 4 and "V = 5" in s.reason and "at least 7" in s.reason for s in result.skipped)
    assert any(e.candidate.vocab_parallel and e.candidate.pp == 2 for e in result.evaluated)
