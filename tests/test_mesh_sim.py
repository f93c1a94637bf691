"""The simulator's data-parallel side: the communication stream, exposed communication,
the link model and static memory by policy."""
from __future__ import annotations

import json

import pytest

from pipeblocks.cli.main import main
from pipeblocks.core import Costs, parse_sharding, simulate
from pipeblocks.core.cost.dp_model import (
    PRECISIONS,
    DPCostModel,
    Link,
    all_gather_time,
    all_reduce_time,
    reduce_scatter_time,
    static_bytes,
    static_peak_bytes,
)
from pipeblocks.core.ir.sharding import ShardingPolicy
from pipeblocks.schedules import get
from pipeblocks.sim.analytic import HARDWARE, MODELS, dp_link, stage_params


def _dp(policy: str, d: int = 2, **kw) -> Costs:
    return Costs(data_parallel=DPCostModel(dp=d, sharding=parse_sharding(policy), **kw))


def test_one_replicated_pipeline_has_no_dp_ops_and_the_same_timeline():
    schedule = get("1f1b")(p=3, m=4)
    plain, with_dp = simulate(schedule), simulate(schedule, _dp("replicate", d=1))
    assert with_dp.events == plain.events and with_dp.comm_events == ()
    assert with_dp.summary()["comm_time"] == [0.0] * 3 and with_dp.summary()["exposed_comm"] == [0.0] * 3


def test_replicate_reduction_at_the_end_of_1f1b_is_exposed():
    # 1F1B p=2 m=2, unit costs: rank 0 ends with 0BW1 at 9, rank 1 with 1BW1 at 7. An
    # all-reduce of one full stage's fp32 gradients (4 units) over d=2 on the unit link
    # (4 per time unit): 2*(1/2)*4/4 = 1.
    t = simulate(get("1f1b")(p=2, m=2), _dp("replicate"))
    assert [[tuple(e) for e in evs] for evs in t.comm_events] == [
        [("0REDUCE_GRAD", 9.0, 10.0)], [("1REDUCE_GRAD", 7.0, 8.0)],
    ]
    assert t.comm_time == (1.0, 1.0) and t.exposed_comm == (1.0, 1.0)
    assert t.makespan == 10.0 and t.step_end == (10.0, 8.0)


def test_zero3_gather_gates_the_first_pass_and_counts_as_exposed():
    # 0UNSHARD (all-gather, (1/2)*4/4 = 0.5) delays 0F0 to 0.5; rank 1's gather hides
    # behind its wait for 0F0's activation. Reductions are reduce-scatters (0.5).
    t = simulate(get("1f1b")(p=2, m=2), _dp("zero3"))
    assert [tuple(e) for e in t.comm_events[0]] == [("0UNSHARD", 0.0, 0.5), ("0REDUCE_GRAD", 9.5, 10.0)]
    assert t.events[0][0].start == 0.5 and t.events[1][0].start == 1.5
    assert t.exposed_comm == (1.0, 0.5)
    assert t.makespan == 10.0  # the step starts with the gather


def test_zero1_and_zero2_gather_parameters_after_the_step():
    t1 = simulate(get("1f1b")(p=2, m=2), _dp("zero1"))
    assert [e.op for e in t1.comm_events[0]] == ["0REDUCE_GRAD", "0OPTIMIZER_GATHER"]
    assert t1.comm_time == (1.5, 1.5) and t1.exposed_comm == (1.5, 1.5)
    t2 = simulate(get("1f1b")(p=2, m=2), _dp("zero2"))
    assert t2.comm_time == (1.0, 1.0) and t2.step_end == (10.0, 8.0)


def test_a_reduction_overlaps_the_compute_after_it():
    # interleaved-1f1b p=2 m=4: rank 0 reduces chunk 2 (half a stage: 0.5) right after
    # 2BW3 while 0BW2 and 0BW3 still run; only chunk 0's reduction is left at the end.
    t = simulate(get("interleaved-1f1b")(p=2, m=4), _dp("replicate"))
    ops = {e.op: e for e in t.comm_events[0]}
    assert ops["2REDUCE_GRAD"].end < t.events[0][-1].end
    assert t.comm_time[0] == pytest.approx(1.0) and t.exposed_comm[0] == pytest.approx(0.5)


def test_link_formulas():
    link = Link(bandwidth=10.0, latency=0.25)
    assert all_reduce_time(100.0, 4, link) == pytest.approx(2 * 3 / 4 * 10 + 2 * 3 * 0.25)
    assert reduce_scatter_time(100.0, 4, link) == pytest.approx(3 / 4 * 10 + 3 * 0.25)
    assert all_gather_time(100.0, 4, link) == reduce_scatter_time(100.0, 4, link)
    assert all_reduce_time(100.0, 1, link) == 0.0
    with pytest.raises(ValueError, match="bandwidth must be a finite number"):
        Link(float("nan"))
    with pytest.raises(ValueError, match="latency must be >= 0"):
        Link(1.0, -1.0)


@pytest.mark.parametrize("d", [2, 4, 8])
def test_static_memory_follows_the_zero_closed_forms(d):
    fp32, mixed = PRECISIONS["fp32"], PRECISIONS["bf16-mixed"]
    replicate = static_bytes(1000, ShardingPolicy.REPLICATE, d, fp32)
    assert replicate == 16000
    ratios = {p: static_bytes(1000, ShardingPolicy(p), d, fp32) / replicate for p in ("zero1", "zero2", "zero3")}
    assert ratios["zero1"] == pytest.approx((8 + 8 / d) / 16)
    assert ratios["zero2"] == pytest.approx((4 + 12 / d) / 16)
    assert ratios["zero3"] == pytest.approx(1 / d)
    # bf16-mixed between steps holds what fp32 does (float32 masters, gradients and state;
    # the bf16 copy lives inside the step): 16, 8 + 8/d, 4 + 12/d, 16/d bytes per parameter
    policies = ("replicate", "zero1", "zero2", "zero3")
    got = [static_bytes(1, ShardingPolicy(p), d, mixed) for p in policies]
    assert got == pytest.approx([16, 8 + 8 / d, 4 + 12 / d, 16 / d])
    # at the step's peak: the bf16 copy (replicate, zero1) or the bf16 gathered parameters
    # beside the float32 shard (zero2, zero3), and full float32 gradients
    peak = [static_peak_bytes(1, ShardingPolicy(p), d, mixed) for p in policies]
    assert peak == pytest.approx([4 + 2 + 4 + 8, 4 + 2 + 4 + 8 / d, 4 / d + 2 + 4 + 8 / d, 4 / d + 2 + 4 + 8 / d])
    fp32_peak = [static_peak_bytes(1, ShardingPolicy(p), d, fp32) for p in policies]
    assert fp32_peak == pytest.approx([16, 8 + 8 / d, 8 + 12 / d, 8 + 12 / d])
    # and the simulator reports them per rank (unit costs: 1 parameter per full stage)
    for policy, ratio in [("replicate", 1.0), *ratios.items()]:
        t = simulate(get("zb-v")(p=2, m=4), _dp(policy, d=d))
        assert t.static_memory == pytest.approx((16 * ratio,) * 2)


def test_dp_traffic_moves_the_bytes_of_the_precision():
    """bf16-mixed gathers bfloat16 parameters (UNSHARD, zero2's regather after the step),
    reduces float32 gradients, and zero1 broadcasts the float32 masters it updated; fp32
    moves 4 bytes everywhere, and "mixed" is bf16-mixed."""
    link = Link(bandwidth=1.0)
    fp32, mixed = (DPCostModel(dp=4, link=link, precision=name) for name in ("fp32", "mixed"))
    assert mixed.precision == "bf16-mixed" and mixed.bytes == PRECISIONS["bf16-mixed"]
    z1, z2, z3 = ShardingPolicy.ZERO1, ShardingPolicy.ZERO2, ShardingPolicy.ZERO3
    for model, (gather, grad, master) in ((fp32, (4, 4, 4)), (mixed, (2, 4, 4))):
        assert model.op_time("UNSHARD", 100, z3) == pytest.approx(all_gather_time(100 * gather, 4, link))
        assert model.op_time("REDUCE_GRAD", 100, z3) == pytest.approx(reduce_scatter_time(100 * grad, 4, link))
        assert model.op_time("REDUCE_GRAD", 100, z1) == pytest.approx(all_reduce_time(100 * grad, 4, link))
        assert model.after_step_time(100, z1) == pytest.approx(all_gather_time(100 * master, 4, link))
        assert model.after_step_time(100, z2) == pytest.approx(all_gather_time(100 * gather, 4, link))
        assert model.after_step_time(100, z3) == 0.0
    with pytest.raises(ValueError, match="precision 'fp8': choose one of fp32, fp64, bf16-mixed"):
        DPCostModel(precision="fp8")


def test_static_memory_per_chunk_policies_and_analytic_parameters():
    config = MODELS["1.5b"]
    h, V, s, L = config.hidden, config.vocab, config.seq, config.layers
    params = stage_params(config, 4)
    assert sum(params) == L * (12 * h * h + 13 * h) + (V + s) * h + 2 * h + h * V
    assert params[0] > params[1] and params[3] > params[1]  # embedding and head on the end stages
    # cloud: replicas inside one node use NVLink, a larger ring runs at the slow inter-node link
    cloud = HARDWARE["cloud"]
    assert dp_link(cloud, 8).bandwidth == cloud.intra_bandwidth
    assert dp_link(cloud, 16).bandwidth == cloud.inter_bandwidth < cloud.intra_bandwidth
    # per-chunk policies on a V placement: rank 0 holds stages 0 and 3
    t = simulate(get("zb-v")(p=2, m=4), _dp("zero3,replicate,replicate,zero1", d=4))
    assert t.static_memory == pytest.approx((0.5 * (16 / 4) + 0.5 * (8 + 8 / 4), 0.5 * 16 * 2))


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_fields_and_text(capsys):
    code, out, _ = run_cli(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--dp", "2", "--sharding", "zero3",
                           "--json")
    data = json.loads(out)
    assert code == 0
    assert data["static_memory"] == [8.0, 8.0] and data["comm_time"] == [1.0, 1.0]
    assert data["exposed_comm"] == [1.0, 0.5] and data["makespan"] == 10.0
    code, out, _ = run_cli(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--dp", "2", "--dp-bandwidth", "8")
    assert code == 0 and "dp=2, sharding=replicate" in out and "exposed DP comm" in out
    # a faster link (8 units per time unit) halves the all-reduce
    code, out, _ = run_cli(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--dp", "2", "--dp-bandwidth", "8",
                           "--json")
    assert json.loads(out)["comm_time"] == [0.5, 0.5]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--sharding", "zero4"), "unknown policy 'zero4'"),
        (("--sharding", "zero1,zero3"), "gives 2 policies but the schedule has 4 chunks"),
        (("--dp-bandwidth", "nan"), "--dp-bandwidth must be a finite number > 0, got nan"),
        (("--dp-bandwidth", "inf"), "--dp-bandwidth must be a finite number > 0, got inf"),
        (("--dp-latency", "-1"), "--dp-latency must be a finite number >= 0"),
        (("--dp", "0"), "dp must be an integer >= 1"),
    ],
)
def test_cli_rejects_bad_mesh_options(capsys, argv, message):
    code, _, err = run_cli(capsys, "simulate", "zb-v", "-p", "2", "-m", "4", "--dp", "2", *argv)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("d", [2, 4])
def test_static_memory_at_the_step_peak_keeps_full_gradients_and_gathered_parameters(d):
    # per parameter, fp32: replicate 16; zero1 4 + 4 + 8/d; zero2 and zero3 4 + 4/d + 4 + 8/d
    # (FSDP2 keeps a zero2 chunk's shard beside its gathered parameters, as zero3's: the
    # textbook ZeRO-2 peak 4 + 4 + 8/d was P/d under what the runtime measures)
    expected = {"replicate": 16, "zero1": 8 + 8 / d, "zero2": 8 + 12 / d, "zero3": 8 + 12 / d}
    for policy, per in expected.items():
        t = simulate(get("1f1b")(p=2, m=2), _dp(policy, d=d))
        assert t.static_memory_peak == pytest.approx((per, per))
        assert all(peak >= rest for peak, rest in zip(t.static_memory_peak, t.static_memory))


def test_auto_sharding_picks_the_fastest_then_the_smallest(capsys):
    from pipeblocks.resolve.auto_sharding import choose_sharding

    schedule = get("zb-v")(p=2, m=4)
    costs = _dp("replicate", d=4)
    chosen = choose_sharding(schedule, costs)
    assert len(chosen) == schedule.num_stages
    best = simulate(schedule, Costs(data_parallel=DPCostModel(dp=4, sharding=chosen)))
    for policy in ShardingPolicy:  # no single policy for all chunks is faster, or as fast and smaller
        uniform = simulate(schedule, _dp(policy.value, d=4))
        assert best.makespan <= uniform.makespan * (1 + 1e-3)
        if abs(best.makespan - uniform.makespan) <= 1e-3 * best.makespan:
            assert max(best.static_memory) <= max(uniform.static_memory)
    # a budget the chosen assignment's peak must fit; below every assignment, a clear error
    fits = choose_sharding(schedule, costs, memory_budget=16)
    timeline = simulate(schedule, Costs(data_parallel=DPCostModel(dp=4, sharding=fits)))
    assert max(s + a for s, a in zip(timeline.static_memory_peak, timeline.peak_activation)) <= 16
    with pytest.raises(ValueError, match="no assignment fits --gpu-memory"):
        choose_sharding(schedule, costs, memory_budget=1)
    code, out, err = run_cli(capsys, "simulate", "zb-v", "-p", "2", "-m", "4", "--dp", "4", "--sharding", "auto",
                             "--json")
    assert code == 0 and json.loads(out)["static_memory"] == list(best.static_memory)
    code, _, err = run_cli(capsys, "simulate", "zb-v", "-p", "2", "-m", "4", "--dp", "4", "--sharding", "auto",
                           "--gpu-memory", "nan")
    assert code == 2 and "--gpu-memory must be a finite number > 0" in err


def test_show_program_and_export_lowered_csv_carry_dp_ops(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "show", "1f1b", "-p", "2", "-m", "2", "--dp", "2", "--sharding", "zero3", "--program")
    assert code == 0 and out.splitlines()[0] == (
        "0: 0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0BW0 0RECV_B1 0BW1 0REDUCE_GRAD 0RESHARD"
    )
    path = tmp_path / "lowered.csv"
    code, _, _ = run_cli(capsys, "export", "zb-v", "-p", "2", "-m", "4", "--dp", "2", "--sharding", "zero3",
                         "--format", "torch-comms-csv", "-o", str(path))
    assert code == 0 and path.read_text().startswith("0UNSHARD,3UNSHARD,0F0,")
    # the lowered CSV loads back as a schedule (its compute order)
    code, out, _ = run_cli(capsys, "simulate", "x", "--file", str(path), "--json")
    assert code == 0 and json.loads(out)["p"] == 2


def test_non_finite_costs_and_parameter_counts_are_rejected():
    with pytest.raises(ValueError, match="cost params must be >= 0 and finite"):
        Costs(params=float("nan"))
    with pytest.raises(ValueError, match="cost t_f must be >= 0 and finite"):
        Costs(t_f=float("inf"))


def test_compare_and_plot_take_the_mesh(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "compare", "-p", "2", "-m", "4", "--schedules", "1f1b,interleaved-1f1b",
                           "--dp", "2", "--sharding", "zero2", "--json")
    data = json.loads(out)
    assert code == 0 and data["dp"] == 2 and data["sharding"] == "zero2"
    rows = {r["schedule"]: r for r in data["schedules"]}
    assert rows["1f1b"]["static_memory"] == [10.0, 10.0] and rows["interleaved-1f1b"]["comm_time"] == [1.0, 1.0]
    code, out, _ = run_cli(capsys, "compare", "-p", "2", "-m", "4", "--schedules", "1f1b", "--dp", "2")
    assert code == 0 and "exp comm" in out
    path = tmp_path / "mesh.svg"
    code, _, _ = run_cli(capsys, "plot", "zb-v", "-p", "2", "-m", "4", "--dp", "2", "--sharding", "zero3",
                         "-o", str(path))
    assert code == 0 and "REDUCE_GRAD" in path.read_text()  # the communication stream's legend
