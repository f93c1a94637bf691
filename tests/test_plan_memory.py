"""The planner's per-rank memory is `estimate_memory`'s, through the planner's own code path
(`plan.search.evaluate`), for the configurations of the reference GPT that
tests/test_memory_fidelity.py measures: with that test (estimate within 5% of the runtime's
measurement) the planner is within 5% of what the runtime measures. One static-memory model
serves the simulator, the planner and the estimate."""
from __future__ import annotations

import dataclasses
import importlib
import math

import pytest

from pipeblocks.core.cost.dp_model import PRECISIONS, DPCostModel, static_peak_bytes
from pipeblocks.core.ir.sharding import ShardingPolicy
from pipeblocks.core.cost.static_memory import chunk_bytes
from pipeblocks.plan import PlanProblem
from pipeblocks.sim.analytic import HARDWARE, TransformerConfig
from pipeblocks.sim.memory_estimate import estimate_memory, rank_static_peak, stage_param_shapes

from _memory_fidelity_cases import ANALYTIC, CASES, MICROBATCH, build_schedule

plan_search = importlib.import_module("pipeblocks.plan.search")


def _planner_case(case: str):
    """The fidelity case as the planner states it: its schedule name and sequence chunk
    count (Seq1F1B is 1F1B with each microbatch in two chunks), mesh and policy."""
    name, p, m, options, dp, sharding = CASES[case]
    k = options.get("seq_chunks", 1)
    if name == "seq1f1b":
        name = "1f1b"
    problem = PlanProblem(
        model=ANALYTIC, hardware=HARDWARE["a100-80g"], gpus=p * dp, gpu_memory=80e9,
        global_batch=dp * MICROBATCH * m, schedules=(name,), microbatch_sizes=(MICROBATCH,), precision="fp32",
        seq_chunks=(k,), tp_degrees=(1,), w_keeps="graph", extrapolate=False,
    )
    return problem, name, k, p, dp, ShardingPolicy(sharding)


@pytest.mark.parametrize("case", list(CASES))
def test_planner_memory_per_rank_is_the_estimate(case):
    problem, name, k, p, dp, policy = _planner_case(case)
    entries, _ = plan_search._entries(problem, name, k)
    [entry] = [e for e in entries if (e.shape.dp, e.shape.tp, e.shape.pp) == (dp, 1, p)]
    [done], skipped, _ = plan_search.evaluate(problem, name, k, entry, shardings=(policy,))
    assert not skipped and done.sharding == str(policy)
    # the schedule the planner simulated: its generator is fed the planner's costs
    costs = plan_search._costs(problem, entry.shape, MICROBATCH, entry.stages, k, policy)
    schedule = plan_search._generate(name, p, entry.m, k, costs)
    estimate = estimate_memory(ANALYTIC, schedule, dp=dp, sharding=(policy,))
    assert len(done.rank_memory) == p
    for r, (static, activation) in enumerate(done.rank_memory):
        want = max((estimate.rank(r, d) for d in range(dp)), key=lambda x: x.total)
        assert static + activation == pytest.approx(want.total, rel=1e-9), f"{case}, rank {r}"
        assert activation == pytest.approx(want.activation_bytes, rel=1e-9), f"{case}, rank {r}"
    assert done.peak_memory == pytest.approx(estimate.peak, rel=1e-9)
    # the very schedule the fidelity test runs, where the generator does not take costs
    # (V-Half and ZB-V search their pass order under the planner's costs: the same memory
    # model, another order of the same passes)
    if CASES[case][0] in ("1f1b", "interleaved-1f1b", "seq1f1b"):
        assert schedule.ranks == build_schedule(case).ranks, case


@pytest.mark.parametrize("policy", list(ShardingPolicy))
@pytest.mark.parametrize("d", [2, 4])
def test_closed_form_peak_is_the_shape_exact_one_when_parameters_split_evenly(policy, d):
    """`dp_model.static_peak_bytes` (the simulator's `static_memory_peak`, the planner's at
    tp > 1 and mixed precision) is `core.cost.static_memory`'s FSDP2/ZeroRedundancyOptimizer
    holdings when dim 0 divides by d and zero1's partition is even: here four equal tensors."""
    shapes = [(8, 3)] * 4
    params = sum(math.prod(s) for s in shapes)
    exact = chunk_bytes(shapes, 4, policy, d, dp_rank=0).peak
    assert static_peak_bytes(params, policy, d, PRECISIONS["fp32"]) == pytest.approx(exact, rel=1e-12)
    simulator = DPCostModel(dp=d, sharding=(policy,), precision="fp32")
    assert simulator.static_memory((params,), (0,), peak=True) == pytest.approx(exact, rel=1e-12)


def test_rank_static_peak_takes_the_worst_replica_and_folds_in_tp():
    config = dataclasses.replace(ANALYTIC, vocab=250)  # 250 rows on 4 replicas: FSDP2 pads to 252
    shapes = stage_param_shapes(config, 2)
    exact = [chunk_bytes(shapes[0], 4, ShardingPolicy.ZERO2, 4, d).peak for d in range(4)]
    assert exact[0] > exact[-1]  # the last replica's state shard is the short one
    assert rank_static_peak(config, 2, (0,), ("zero2",), dp=4, precision="fp32") == max(exact)
    # tp = 2: one tensor-parallel rank's share (its norms and row-parallel biases whole), held alike
    split = stage_param_shapes(config, 2, tp=2)
    params = sum(math.prod(s) for s in split[0])
    assert params > sum(math.prod(s) for s in shapes[0]) / 2
    mixed = rank_static_peak(config, 2, (0,), ("zero1",), dp=4, precision="mixed", tp=2)
    # bf16-mixed: master, copy, gradient, state/d (zero1 partitions whole tensors: nearly even)
    assert mixed == pytest.approx(params * (4 + 2 + 4 + 8 / 4), rel=0.02)
    with pytest.raises(ValueError, match="tp must be an integer >= 1, got 0"):
        rank_static_peak(config, 2, (0,), ("zero1",), dp=4, precision="fp32", tp=0)


def test_a_sharding_the_mesh_cannot_run_is_refused():
    problem, name, k, p, _, _ = _planner_case("1f1b p=4")
    [entry] = [e for e in plan_search._entries(problem, name, k)[0] if e.shape.dp == 1 and e.shape.pp == p]
    with pytest.raises(ValueError, match="only replicate"):
        plan_search.evaluate(problem, name, k, entry, shardings=(ShardingPolicy.ZERO1,))


def test_the_planner_refuses_an_unknown_precision_or_w_keeps():
    base = dict(model=TransformerConfig(layers=4, hidden=64, heads=4, seq=64), hardware=HARDWARE["a100-80g"],
                gpus=2, gpu_memory=80e9, global_batch=4)
    with pytest.raises(ValueError, match="--precision 'fp8': choose one of fp32, fp64, bf16-mixed"):
        PlanProblem(**base, precision="fp8")
    assert PlanProblem(**base, precision="mixed").precision == "bf16-mixed"
    with pytest.raises(ValueError, match="--w-keeps 'all': choose one of graph, weights"):
        PlanProblem(**base, w_keeps="all")


def test_cli_dropout_and_w_keeps_reach_the_problem():
    from pipeblocks.cli.main import build_parser
    from pipeblocks.cli.plan import problem_from_args

    argv = ["plan", "--model", "8,64,4,64,256", "--gpus", "4", "--gpu-memory", "80", "--global-batch", "16"]
    default = problem_from_args(build_parser().parse_args(argv))
    assert default.model.dropout and default.w_keeps == "graph"
    changed = problem_from_args(build_parser().parse_args(argv + ["--no-dropout", "--w-keeps", "weights", "--fp32"]))
    assert not changed.model.dropout and changed.w_keeps == "weights" and changed.precision == "fp32"
