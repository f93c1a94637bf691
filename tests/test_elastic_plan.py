"""Elastic groups and per-chunk sharding chosen together (`elastic --sharding auto`)."""
import dataclasses
import json

import pytest

from pipeblocks.cli.main import main
from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.core.lowering.entry import lower_for
from pipeblocks.core.lowering.passes_dp import check_dp_ops
from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.core.ir.sharding import ShardingPolicy
from pipeblocks.core.simulator.simulate import simulate
from pipeblocks.core.lowering.validate import validate
from pipeblocks.resolve.build import build, data_parallel, resolve_costs
from pipeblocks.resolve.elastic_plan import choose_elastic_plan
from pipeblocks.resolve.recompute_auto import fits_memory

ZERO3 = (ShardingPolicy.ZERO3,)


def _costs(model: str, dp: int, p: int, v: int):
    request = ScheduleRequest(name="elastic", m=8, mesh=Mesh(pp=p, dp=dp), costs=CostSpec(model=model, hardware="cloud"),
                              sharding=ZERO3)
    costs = resolve_costs(request.costs, p * v)
    return dataclasses.replace(costs, data_parallel=data_parallel(request))


def _check_plan(plan, costs, budget):
    """The plan's schedule validates, its DP ops are well placed, and it fits the budget."""
    validate(plan.schedule)
    trial = dataclasses.replace(costs, data_parallel=dataclasses.replace(costs.data_parallel, sharding=plan.sharding))
    program = lower_for(plan.schedule, policies=plan.sharding, dp=trial.data_parallel.dp, recompute=plan.recompute)
    check_dp_ops(program, plan.sharding)
    timeline = simulate(plan.schedule, trial, recompute=plan.recompute)
    assert fits_memory(timeline, budget)
    assert timeline.makespan == pytest.approx(plan.makespan)
    forward, backward = plan.schedule.option("forward_groups"), plan.schedule.option("backward_groups")
    assert sum(forward) == sum(backward) == plan.schedule.m
    assert plan.schedule.option("groups_from") == "joint"


@pytest.mark.parametrize("model, dp, budget", [("6.2b", 16, 60e9), ("1.5b", 16, 24e9)])
def test_joint_search_beats_or_equals_groups_only_and_sharding_only(model, dp, budget):
    # inter-node DP ring (d=16 on `cloud`): communication-bound
    costs = _costs(model, dp, p=2, v=2)
    plan = choose_elastic_plan(2, 8, 2, costs, budget=budget, recompute=True, start=ZERO3, unit=1e9)
    assert plan.makespan <= min(plan.groups_only, plan.sharding_only) * (1 + 1e-3)
    assert plan.simulated > 10
    _check_plan(plan, costs, budget)


def test_joint_search_error_names_the_budget():
    costs = _costs("6.2b", 16, p=2, v=2)
    with pytest.raises(ScheduleError, match=r"--gpu-memory 5 is too small for .elastic.*raise --gpu-memory to at least"):
        choose_elastic_plan(2, 8, 2, costs, budget=5e9, recompute=True, start=ZERO3, unit=1e9)


def test_build_uses_the_joint_search_and_simulate_json_shows_the_choice(capsys):
    request = ScheduleRequest(
        name="elastic", m=8, mesh=Mesh(pp=2, dp=16), options=(("v", 2),), costs=CostSpec(model="6.2b", hardware="cloud"),
        auto_sharding=True, gpu_memory=60.0, recompute="auto",
    )
    built = build(request)
    assert built.schedule.option("groups_from") == "joint" and len(built.request.sharding) == 4
    code = main(["simulate", "elastic", "-p", "2", "-m", "8", "--model", "6.2b", "--hardware", "cloud", "--dp", "16",
                 "--sharding", "auto", "--gpu-memory", "60", "--recompute", "auto", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["fits_memory"] is True
    assert out["options"]["groups_from"] == "joint" and sum(out["options"]["forward_groups"]) == 8
    assert out["sharding"] == [str(p) for p in built.request.sharding]
    # explicit groups keep the sharding-only search (no joint choice of groups)
    code = main(["simulate", "elastic", "-p", "2", "-m", "8", "--forward-groups", "4,4", "--model", "6.2b",
                 "--hardware", "cloud", "--dp", "16", "--sharding", "auto", "--gpu-memory", "80", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["options"]["groups_from"] == "given" and len(out["sharding"]) == 4


def test_emulated_case_takes_generator_options_and_orders_as_the_simulator():
    # the benchmark's emulated check (benchmarks/pipemesh.py --emulated), simulated side:
    # chunk 1's 40 ms all-reduce hides under 2 (depth-first), 6 (elastic 6,2 / 2,6) or 8
    # (bfs) backwards of chunk 0, 8 ms each
    from _emulated_mesh import EmulatedMeshCase, predict_emulated_mesh

    common = dict(p=2, dp=2, m=8, f_ms=4.0, b_ms=4.0, w_ms=4.0, stage_params=(4e6,) * 4, bandwidth=2e8)
    elastic = EmulatedMeshCase("elastic", options=(("v", 2), ("forward_groups", (6, 2)), ("backward_groups", (2, 6))),
                               **common)
    assert elastic.build_schedule().option("forward_groups") == (6, 2)
    step = {name: predict_emulated_mesh(case)["step_s"] for name, case in (
        ("depth-first", EmulatedMeshCase("interleaved-1f1b", options=(("v", 2),), **common)),
        ("elastic", elastic),
        ("breadth-first", EmulatedMeshCase("bfs", options=(("v", 2),), **common)),
    )}
    assert step == pytest.approx({"depth-first": 0.348, "elastic": 0.316, "breadth-first": 0.300})
