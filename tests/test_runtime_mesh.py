"""The mesh on gloo: p=2 pipeline ranks x d=2 replicas, the four sharding policies on
zb-v, v-half, interleaved-1f1b and seq1f1b (k=2), against one process training the whole
model on the global batch; static bytes measured against predicted; bad input before launch;
a replica failing inside a collective stops every rank with its error."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeblocks.resolve.request import Mesh, ScheduleRequest
from pipeblocks.core.ir.sharding import ShardingPolicy
from pipeblocks.models import GPTConfig
from pipeblocks.runtime import RankFailedError, spawn
from pipeblocks.runtime.mesh import check_world_size
from pipeblocks.core.cost.static_memory import chunk_bytes
from pipeblocks.train import run as training
from pipeblocks.train.reference import reference_update, relative_difference

from _mesh_cases import LR, M, MODEL, SCHEDULES, failing_collective_worker, global_batch, matrix_worker

pytestmark = pytest.mark.spawn

POLICIES = ("replicate", "zero1", "zero2", "zero3")
P, D = 2, 2
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchrun_gpt.py"


@pytest.fixture(scope="module")
def matrix():
    cases = [(name, policy) for name in SCHEDULES for policy in POLICIES]
    cases.append(("interleaved-1f1b", "zero3,replicate,zero1,zero2"))  # a policy per chunk
    per_rank = spawn(matrix_worker, P * D, args=(P, D, cases), timeout_s=300, threads_per_rank=1)
    x, y = global_batch(D, 0)
    loss, grads, params, _ = reference_update(MODEL, seed=0, inputs=x, targets=y, microbatches=D * M, lr=LR,
                                              max_norm=None)
    return cases, per_rank, (loss, grads, params)


def _largest(got: dict, expected: dict) -> float:
    assert got.keys() == expected.keys()
    return max(relative_difference(got[name], expected[name]) for name in expected)


def test_every_policy_and_schedule_equals_one_process(matrix):
    cases, per_rank, (ref_loss, ref_grads, ref_params) = matrix
    for index, case in enumerate(cases):
        for replica in range(D):
            ranks = [r[index] for r in per_rank if r[index]["dp_rank"] == replica]
            assert all(r["case"] == case for r in ranks)
            grads = {n: g for r in ranks for n, g in r["grads"].items()}
            params = {n: t for r in ranks for n, t in r["params"].items()}
            loss = next(r["loss"] for r in ranks if r["loss"] is not None)
            # each replica's loss is the mean over its own m microbatches; their mean is the step's
            other = next(r[index]["loss"] for r in per_rank if r[index]["dp_rank"] != replica and r[index]["loss"])
            assert relative_difference((loss + other) / 2, ref_loss) <= 1e-12, case
            assert _largest(grads, ref_grads) <= 1e-10, (case, replica)
            assert _largest(params, ref_params) <= 1e-10, (case, replica)


def test_static_bytes_measured_match_the_prediction(matrix):
    cases, per_rank, _ = matrix
    for index, case in enumerate(cases):
        for rank in per_rank:
            for step, (measured, predicted) in enumerate(rank[index]["static"]):
                assert measured > 0
                assert abs(measured - predicted) <= 0.05 * predicted, (case, rank[index]["pp_rank"], step)


def test_programs_hold_the_dp_ops_their_policies_need(matrix):
    cases, per_rank, _ = matrix
    for index, (name, policy) in enumerate(cases):
        policies = policy.split(",")
        for rank in per_rank:
            ops = rank[index]["program"]
            for stage in rank[index]["stages"]:
                chunk_policy = policies[stage] if len(policies) > 1 else policies[0]
                assert ops.count(f"{stage}REDUCE_GRAD") == 1, (name, policy, stage)
                gathers = ops.count(f"{stage}UNSHARD"), ops.count(f"{stage}RESHARD")
                assert gathers == ((1, 1) if chunk_policy == "zero3" else (0, 0)), (name, policy, stage, ops)


def test_sharded_policies_hold_less_than_replicate(matrix):
    cases, per_rank, _ = matrix
    steady = {case: [r[i]["static"][1][0] for r in per_rank] for i, case in enumerate(cases)}
    for name in SCHEDULES:
        replicate = steady[(name, "replicate")]
        for policy in ("zero1", "zero2", "zero3"):
            assert all(s < r for s, r in zip(steady[(name, policy)], replicate)), (name, policy)


def test_chunk_bytes_follow_fsdp_padding_and_zero_partition():
    # 5 rows on 2 replicas: padded shards of 3 rows; replica 1's optimizer state has 2 rows
    one = chunk_bytes([(5, 4)], 8, ShardingPolicy.ZERO3, 2, dp_rank=1)
    assert (one.params, one.gathered, one.grads_full, one.grads_reduced) == (3 * 4 * 8, 6 * 4 * 8, 5 * 4 * 8, 3 * 4 * 8)
    assert one.optimizer == 2 * 2 * 4 * 8
    # zero1: the largest tensor to replica 0, the next two to replica 1 (fewest elements)
    zero1 = [chunk_bytes([(10,), (6,), (3,)], 4, ShardingPolicy.ZERO1, 2, dp_rank=r).optimizer for r in (0, 1)]
    assert zero1 == [2 * 10 * 4, 2 * 9 * 4]


def test_a_replica_failing_inside_a_collective_stops_every_rank_with_its_error():
    with pytest.raises(RankFailedError) as info:
        spawn(failing_collective_worker, 2, args=(1,), timeout_s=120, threads_per_rank=1)
    assert info.value.rank == 1
    assert "replica 1 failed inside its all-reduce on purpose" in str(info.value)


def test_the_executor_refuses_dp_ops_without_data_parallelism():
    from pipeblocks import schedules
    from pipeblocks.core.lowering.lower import PASSES, lower
    from pipeblocks.core.ir.ops import UnknownOpError
    from pipeblocks.core.lowering.passes_dp import dp_passes
    from pipeblocks.runtime.executor import RankExecutor

    schedule = schedules.get("1f1b")(p=2, m=2)
    program = lower(schedule, PASSES + dp_passes([ShardingPolicy.ZERO3], 2))
    with pytest.raises(UnknownOpError, match=r"cannot run op 0UNSHARD \(type dp\)"):
        RankExecutor(program, 0, None, None, None, {}, {})


# ---- bad input, before anything is launched ------------------------------------------------
def _prepare(tmp_path=None, **request):
    options = {"name": "zb-v", "m": 2, "mesh": Mesh(pp=2, dp=2), **request}
    model = GPTConfig(layers=4, hidden=8, heads=2, seq=8, vocab=256, dtype="float64")
    data = None
    if tmp_path is not None:
        data = tmp_path / "tiny.txt"
        data.write_text("x" * 20)
    return training.prepare(ScheduleRequest(**options), model=model, microbatch_size=2, verify=True,
                            data=None if data is None else str(data))


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown policy 'zero4'; choose one of replicate, zero1, zero2, zero3"):
        _prepare(sharding="zero4")


def test_policy_list_of_the_wrong_length_is_a_clear_error():
    with pytest.raises(ValueError, match="gives 3 policies but the schedule has 4 chunks"):
        _prepare(sharding="zero1,zero2,zero3")


def test_more_replicas_than_the_data_allows_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"--dp 8: a step takes dp x m x microbatch = 8 x 2 x 2 = 32 sequences"):
        _prepare(tmp_path, mesh=Mesh(pp=2, dp=8))


def test_clip_grad_with_data_parallelism_is_refused_before_launch():
    with pytest.raises(ValueError, match="--clip-grad is not supported with data parallelism"):
        training.prepare(ScheduleRequest(name="zb-v", m=2, mesh=Mesh(pp=2, dp=2)),
                         model=GPTConfig(layers=4, hidden=8, heads=2, seq=8), clip_grad=1.0)


def test_auto_sharding_trains_with_the_policies_the_simulator_chose():
    from pipeblocks.core.ir.sharding import per_stage
    from pipeblocks.resolve.build import build

    request = ScheduleRequest(name="zb-v", m=2, mesh=Mesh(pp=2, dp=2), auto_sharding=True)
    cfg, _ = training.prepare(request, model=GPTConfig(layers=4, hidden=8, heads=2, seq=8), verify=True)
    chosen = build(request).request.sharding
    assert cfg.sharding == per_stage(chosen, 4)


def test_world_size_not_p_times_d_is_a_clear_error():
    with pytest.raises(ValueError, match=r"the mesh needs p x d = 2 x 2 = 4 processes but the world has 3"):
        check_world_size(2, 2, 3)


def test_torchrun_with_the_wrong_world_size_fails_before_training(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         str(EXAMPLE), "--pp", "2", "--dp", "2", "--steps", "1"],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "the mesh needs p x d = 2 x 2 = 4 processes but the world has 1" in proc.stderr
    assert "loss" not in proc.stdout


def test_report_has_a_row_per_process_with_dp_fields():
    """The report's new fields, from hand-made results (no launch)."""
    from pipeblocks import schedules
    from pipeblocks.core.simulator.simulate import simulate
    from pipeblocks.train.report import RankResult, build_report

    schedule = schedules.get("1f1b")(p=2, m=2)
    timeline = simulate(schedule)
    results = [
        RankResult(r, (r,), ((0, 1.0),) if r == 1 else (), ((0, 0.0, 1.0),), 10,
                   ((0, timeline),) if (r, d) == (0, 0) else (), dp_rank=d, static_bytes_measured=100 + r,
                   static_bytes_predicted=100, dp_wait_s=(0.5,))
        for d in range(2) for r in range(2)
    ]
    memory = [type("M", (), {"m_b": 1.0, "m_w": 1.0})() for _ in range(2)]
    data = build_report(schedule, results, memory, warmup=0, dp=2, sharding=["zero2", "zero2"]).data
    assert data["dp"] == 2 and data["sharding"] == ["zero2", "zero2"]
    assert [(row["rank"], row["dp_rank"]) for row in data["ranks"]] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [row["static_bytes_measured"] for row in data["ranks"]] == [100, 101, 100, 101]
    assert all(row["dp_comm_exposed_s_measured"] == 0.5 for row in data["ranks"])
    assert all(row["dp_comm_exposed_s_simulated"] is None for row in data["ranks"])
    # emulated passes make no gradients: the static bytes a rank held are not the run's
    from pipeblocks.train.report import format_report

    emulated = build_report(schedule, results, memory, warmup=0, dp=2, sharding=["zero2", "zero2"], emulated=True)
    assert [row["static_bytes_measured"] for row in emulated.data["ranks"]] == [None] * 4
    assert format_report(emulated.data).count("n/a (emulated)") == 8  # activations and static, per row
