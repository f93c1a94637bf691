"""The planner (`pipeblocks plan`): its memory is estimate_memory's, its search orders the
Controllable Memory paper's Table 3 as the paper does, and bad input is refused."""
from __future__ import annotations

import dataclasses
import importlib
import json
import math
import shlex

import pytest

from pipeblocks.cli.main import build_parser, main
from pipeblocks.plan import PlanProblem, search
from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.plan.costs import replica_costs
from pipeblocks.plan.intensity import gemm_efficiency, layer_efficiency
from pipeblocks.sim.analytic import HARDWARE, MODELS, TransformerConfig

plan_search = importlib.import_module("pipeblocks.plan.search")

A100 = HARDWARE["a100-80g"]


def _problem(seq: int, batch: int, **changes) -> PlanProblem:
    model = dataclasses.replace(MODELS["98.5b"], seq=seq, flash_attention=True)
    return PlanProblem(model=model, hardware=A100, gpus=40, gpu_memory=80e9, global_batch=batch, **changes)


def test_presets_of_the_controllable_memory_paper():
    assert (MODELS["98.5b"].layers, MODELS["98.5b"].heads, MODELS["98.5b"].hidden) == (78, 80, 10240)
    assert (MODELS["9.6b"].layers, MODELS["21b"].hidden, MODELS["38.5b"].heads) == (30, 6144, 64)
    assert A100.gpus_per_node == 8 and A100.intra_bandwidth > A100.inter_bandwidth


@pytest.mark.parametrize("intensity", [False, True])
def test_planner_memory_at_tp1_is_what_simulate_reports(capsys, intensity):
    """The planner's peak per GPU is the simulator's static + activation memory, the number
    `simulate --model ... --dp ... --mixed-precision` reports for the same configuration.
    Without the intensity model its step time is `simulate`'s too; with it, every pass is
    slower by exactly the layer's (or the head's) GEMM efficiency, and so is the step."""
    model = dataclasses.replace(MODELS["9.6b"], seq=512)
    problem = PlanProblem(model=model, hardware=A100, gpus=8, gpu_memory=80e9, global_batch=16,
                          schedules=("v-half",), microbatch_sizes=(2,), tp_degrees=(1,), intensity=intensity)
    entry = next(e for e in plan_search._entries(problem, "v-half", 1)[0] if (e.shape.dp, e.shape.pp) == (2, 4))
    [done], _, _ = plan_search.evaluate(problem, "v-half", 1, entry)
    assert main([
        "simulate", "v-half", "-p", "4", "-m", "4", "--model", "30,5120,40,512,51200,2", "--hardware", "a100-80g",
        "--dp", "2", "--mixed-precision", "--sharding", done.sharding, "--json",
    ]) == 0
    summary = json.loads(capsys.readouterr().out)
    need = max(s + a for s, a in zip(summary["static_memory_peak"], summary["peak_activation"]))
    assert done.peak_memory == pytest.approx(need, rel=1e-12)
    if not intensity:
        assert done.iteration_time == pytest.approx(summary["makespan"], rel=1e-12)
        return
    config = dataclasses.replace(model, microbatch_size=2)
    plain = replica_costs(config, A100, num_stages=entry.stages, dp=2, tp=1)
    slowed = replica_costs(config, A100, num_stages=entry.stages, dp=2, tp=1, intensity=True)
    layer = layer_efficiency(config, A100, 1)
    assert 0.5 < layer < 1
    for times, base in ((slowed.t_f, plain.t_f), (slowed.t_b, plain.t_b), (slowed.t_w, plain.t_w)):
        assert [t * layer for t in times[:-1]] == pytest.approx(base[:-1], rel=1e-12)
        assert times[-1] > base[-1]  # the head is slowed by its own, different efficiency
    assert done.iteration_time > summary["makespan"] * 1.05


def test_gemm_efficiency_is_the_smooth_roofline_of_the_data_sheet():
    """A square n-GEMM in bf16 does 2n^3 FLOPs over 6n^2 bytes, intensity n/3; the A100 80GB
    ridge is 312 TFLOP/s over 2039 GB/s."""
    ridge = 312e12 / 2.039e12
    assert gemm_efficiency(8192, 8192, 8192, ridge=ridge, dtype_bytes=2) == pytest.approx(1 / (1 + ridge * 3 / 8192))
    config = dataclasses.replace(MODELS["98.5b"], seq=1024)
    by_microbatch = [layer_efficiency(dataclasses.replace(config, microbatch_size=b), A100, 4) for b in (1, 2, 4)]
    assert by_microbatch == sorted(by_microbatch) and by_microbatch[1] / by_microbatch[0] > 1.03
    by_tp = [layer_efficiency(config, A100, t) for t in (1, 2, 4, 8)]
    assert by_tp == sorted(by_tp, reverse=True)
    # a sequence chunk runs the GEMMs of a shorter sequence
    whole = replica_costs(config, A100, num_stages=10, dp=1, tp=4, intensity=True)
    halves = replica_costs(config, A100, num_stages=10, dp=1, tp=4, intensity=True, seq_chunks=2)
    assert halves.t_w[3] > whole.t_w[3]


def test_the_intensity_model_needs_a_memory_bandwidth():
    bare = dataclasses.replace(A100, memory_bandwidth=None)
    with pytest.raises(ValueError, match="no memory_bandwidth.*--intensity-model off"):
        PlanProblem(model=MODELS["9.6b"], hardware=bare, gpus=8, gpu_memory=80e9, global_batch=8)
    PlanProblem(model=MODELS["9.6b"], hardware=bare, gpus=8, gpu_memory=80e9, global_batch=8, intensity=False)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ScheduleError, match="memory_bandwidth must be a finite number"):
            dataclasses.replace(A100, memory_bandwidth=bad)


def test_tensor_parallelism_divides_compute_and_memory_and_adds_all_reduces():
    config = dataclasses.replace(MODELS["98.5b"], microbatch_size=1)
    one = replica_costs(config, A100, num_stages=10, dp=1, tp=1)
    four = replica_costs(config, A100, num_stages=10, dp=1, tp=4)
    # a tp rank saves 2h + 14h/t of a layer's 16h elements per token (sim.tp_memory): the gathered GEMM inputs stay whole
    assert one.mem_b[0] / 4 < four.mem_b[0] < one.mem_b[0] * (2 + 14 / 4) / 16 * 1.01
    assert four.params[3] == pytest.approx(one.params[3] / 4)
    assert four.t_w[2] == pytest.approx(one.t_w[2] / 4)  # W has no tensor-parallel collective
    assert four.t_f[2] > one.t_f[2] / 4 and four.t_b[2] > one.t_b[2] / 4
    # the all-reduces: 2 per layer and pass, 2(t-1)/t of s*b*h bf16 values over NVLink
    layers = 8
    expected = layers * 2 * (2 * 3 / 4 * 1024 * 10240 * 2 / A100.intra_bandwidth + 2 * 3 * A100.intra_latency)
    assert four.t_f[2] - one.t_f[2] / 4 == pytest.approx(expected)


def test_the_mfu_bound_holds():
    problem = _problem(1024, 160, schedules=("1f1b",), tp_degrees=(8,), microbatch_sizes=(2,))
    entries, _ = plan_search._entries(problem, "1f1b", 1)
    for entry in entries:
        [done], _, _ = plan_search.evaluate(problem, "1f1b", 1, entry)
        assert done.mfu <= entry.bound


@pytest.mark.sweep
def test_table3_ordering_at_seq_1024():
    """98.5B on 40 A100-80G, seq 1024, batch 160: V-ZB best, ZB-1P next, 1F1B-R last, V-ZB
    about 10% over 1F1B, and 1F1B best at the paper's dp 2, tp 4, pp 5, mb 2 (with the
    intensity model a larger microbatch runs faster GEMMs, which pays against 1F1B's bubble
    up to mb 2). Restricted to tp 4 and microbatch sizes 1, 2, 4, where every schedule's
    best lies in the full grid (benchmarks/plan_table3.py)."""
    names = ("1f1b", "1f1b-r", "zb-1p", "v-min", "v-half", "v-zb")
    result = search(_problem(1024, 160, schedules=names, tp_degrees=(4,), microbatch_sizes=(1, 2, 4)), jobs=1)
    best = {name: e.mfu for name, e in result.best_per_schedule.items()}
    assert set(best) == set(names)
    order = sorted(best, key=best.get, reverse=True)
    assert order[0] == "v-zb" and order[1] == "zb-1p" and order[-1] == "1f1b-r"
    assert best["v-half"] > best["v-min"]
    # 1.08 where a tp rank's activation was taken as 1/tp of the stage's (Megatron-LM re-gathers the
    # sequence-parallel GEMM inputs in the backward); pipeblocks' DTensor keeps them whole
    # (sim.tp_memory), which costs V-ZB its microbatch of 4
    assert best["v-zb"] / best["1f1b"] > 1.07
    one = result.best_per_schedule["1f1b"].candidate
    assert (one.dp, one.tp, one.pp, one.microbatch_size) == (2, 4, 5, 2)


def test_bad_input_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match="do not divide into any"):
        search(_problem(1024, 160, tp_degrees=(3,)))
    with pytest.raises(ValueError, match="not divisible by dp x microbatch size"):
        search(PlanProblem(model=MODELS["9.6b"], hardware=A100, gpus=4, gpu_memory=80e9, global_batch=3,
                           microbatch_sizes=(2,), schedules=("1f1b",)))
    with pytest.raises(ValueError, match="more than the 8 GPUs per node"):
        _problem(1024, 160, tp_degrees=(16,))
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="--gpu-memory must be a finite number"):
            PlanProblem(model=MODELS["9.6b"], hardware=A100, gpus=8, gpu_memory=bad, global_batch=8)
    with pytest.raises(ValueError, match="unknown schedule"):
        _problem(1024, 160, schedules=("nope",))
    # named directly, a Seq1F1B schedule would be priced as whole sequences
    with pytest.raises(ValueError, match="--schedules seq1f1b: the planner splits sequences itself; name 1f1b"):
        _problem(1024, 160, schedules=("seq1f1b",))
    with pytest.raises(ValueError, match="name interleaved-1f1b and give --seq-chunks"):
        _problem(1024, 160, schedules=("seq1f1b-i",))


def test_a_model_that_fits_nowhere_says_the_least_memory_it_needs(capsys):
    status = main(["plan", "--model", "98.5b", "--gpus", "8", "--gpu-memory", "80", "--global-batch", "8",
                   "--schedules", "1f1b", "--jobs", "1"])
    err = capsys.readouterr().err
    assert status == 2
    assert "no configuration of 8 GPUs fits 80 GB" in err and "the least any configuration needs is" in err
    least = float(err.split("needs is ")[1].split(" GB")[0])
    assert least > 80
    assert "(sequence chunks 2,4 tried too)" in err


def test_cli_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "plan.png"
    assert main(["plan", "--model", "9.6b", "--gpus", "8", "--gpu-memory", "80", "--global-batch", "16",
                 "--seq", "512", "--schedules", "1f1b,v-half", "--microbatch-sizes", "1,2", "--jobs", "1",
                 "--json", "--plot", str(plot)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["best_per_schedule"]) == {"1f1b", "v-half"}
    for row in data["best_per_schedule"].values():
        assert {"mfu", "dp", "tp", "pp", "microbatch_size", "peak_memory"} <= set(row)
        assert row["dp"] * row["tp"] * row["pp"] == 8 and row["peak_memory"] <= 80e9
    mfus = [row["mfu"] for row in data["ranked"]]
    assert mfus == sorted(mfus, reverse=True) and data["ranked"][0]["mfu"] == max(
        r["mfu"] for r in data["best_per_schedule"].values())
    train = next(line for line in data["commands"] if line.startswith("pipeblocks train --schedule"))
    parsed = build_parser().parse_args(shlex.split(train)[1:])  # every option it writes is one train takes
    best = data["ranked"][0]
    assert (parsed.name, parsed.p, parsed.m, parsed.microbatch_size, parsed.tp) == (
        best["schedule"], best["pp"], best["m"], best["microbatch_size"], best["tp"])
    assert parsed.precision == data["precision"] == "bf16-mixed"  # the precision the memory was priced with
    assert plot.stat().st_size > 1000


def test_seq_chunks_variant_is_searched():
    model = dataclasses.replace(MODELS["9.6b"], seq=2048, flash_attention=True)
    problem = PlanProblem(model=model, hardware=A100, gpus=4, gpu_memory=80e9, global_batch=8, schedules=("1f1b",),
                          microbatch_sizes=(1,), seq_chunks=(2,), tp_degrees=(1,))
    labels = {e.candidate.label for e in search(problem, jobs=1).evaluated}
    assert labels == {"1f1b", "1f1b+seq2"}


def test_sequence_chunks_are_tried_when_nothing_fits_whole():
    """A 4096-token model whose activation, not its parameters, fills 4.5 GB: whole
    sequences fit no mesh, the automatic 2 and 4 chunks do; with room to spare, or with
    chunking turned off, no chunked schedule is searched."""
    model = TransformerConfig(layers=8, hidden=1024, heads=8, seq=4096, vocab=1024, flash_attention=True)

    def plan(memory: float, **changes) -> plan_search.PlanResult:
        return search(PlanProblem(model=model, hardware=A100, gpus=4, gpu_memory=memory, global_batch=32,
                                  schedules=("1f1b",), microbatch_sizes=(4,), tp_degrees=(1,), **changes), jobs=1)

    assert not plan(4.5e9, seq_chunks=(1,)).ranked
    tight = plan(4.5e9)
    assert tight.seq_chunks == (1, 2, 4) and tight.ranked
    assert tight.ranked[0].candidate.seq_chunks > 1 and tight.ranked[0].peak_memory <= 4.5e9
    # the example script has no sequence chunks: both commands run pipeblocks train with them
    from pipeblocks.plan.report import commands

    chunks = f"--seq-chunks {tight.ranked[0].candidate.seq_chunks}"
    assert all(chunks in line and "examples/" not in line for line in commands(tight))
    roomy = plan(80e9)
    assert roomy.seq_chunks == (1,) and {e.candidate.seq_chunks for e in roomy.evaluated} == {1}


def test_long_sequences_try_chunks_from_the_start():
    long = dataclasses.replace(MODELS["9.6b"], seq=plan_search.LONG_SEQUENCE, flash_attention=True)
    problem = PlanProblem(model=long, hardware=A100, gpus=8, gpu_memory=80e9, global_batch=8)
    assert plan_search.seq_chunk_rounds(problem) == ((1,), plan_search.AUTO_SEQ_CHUNKS, True)
    short = dataclasses.replace(problem, model=dataclasses.replace(long, seq=2048))
    assert plan_search.seq_chunk_rounds(short) == ((1,), plan_search.AUTO_SEQ_CHUNKS, False)
    assert plan_search.seq_chunk_rounds(dataclasses.replace(problem, seq_chunks=(1,))) == ((1,), (), False)
    assert plan_search.seq_chunk_rounds(dataclasses.replace(problem, seq_chunks=(4, 2))) == ((1, 2, 4), (), False)


def test_a_long_step_on_the_line_through_two_shorter_ones_matches_its_simulation():
    """m = 48 on p = 4 timed from m = 8 and 16 against the full simulation: within 0.5%."""
    model = dataclasses.replace(MODELS["9.6b"], seq=1024, flash_attention=True)
    for name in ("1f1b", "v-half", "zb-1p"):
        found = {}
        for extrapolate in (True, False):
            # one replica: one sharding policy, so the two runs compare the same configuration
            problem = PlanProblem(model=model, hardware=A100, gpus=4, gpu_memory=80e9, global_batch=48,
                                  schedules=(name,), microbatch_sizes=(1,), tp_degrees=(1,), extrapolate=extrapolate)
            entry = next(e for e in plan_search._entries(problem, name, 1)[0] if (e.shape.dp, e.shape.pp) == (1, 4))
            [done], _, _ = plan_search.evaluate(problem, name, 1, entry)
            found[extrapolate] = done
        line, full = found[True], found[False]
        assert line.simulated_m == (8, 16) and full.simulated_m == (48,)
        assert line.iteration_time == pytest.approx(full.iteration_time, rel=5e-3)
        assert line.peak_memory == pytest.approx(full.peak_memory, rel=1e-9)


@pytest.mark.sweep
def test_table3_ordering_at_seq_3072_memory_binds_and_v_half_overtakes_v_zb():
    """98.5B, seq 3072, batch 640: V-ZB's best mesh is not the one V-Half runs best on,
    because V-ZB's activation does not fit there, and V-Half ends above V-ZB. Restricted to
    tp 2 and 4 and microbatch size 1 (where both bests lie in the full grid)."""
    names = ("1f1b-r", "v-half", "v-zb")
    result = search(_problem(3072, 640, schedules=names, tp_degrees=(2, 4), microbatch_sizes=(1,)), jobs=1)
    best = result.best_per_schedule
    assert best["v-half"].mfu > best["v-zb"].mfu > best["1f1b-r"].mfu
    half = best["v-half"].candidate
    blocked = [e for e in result.evaluated if e.candidate.schedule == "v-zb"
               and (e.candidate.dp, e.candidate.tp, e.candidate.pp) == (half.dp, half.tp, half.pp)]
    assert (best["v-zb"].candidate.tp, best["v-zb"].candidate.pp) != (half.tp, half.pp)
    assert blocked and all(not e.fits and e.peak_memory > 80e9 for e in blocked)


def test_a_tensor_parallel_plan_prints_commands_with_tp(capsys):
    assert main(["plan", "--model", "9.6b", "--gpus", "8", "--gpu-memory", "40", "--global-batch", "32",
                 "--schedules", "1f1b,v-half", "--microbatch-sizes", "1", "--flash-attention", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    table, _, run = out.partition("run the best plan:")
    best = table.splitlines()[2].split()
    assert best[0] == "1" and int(best[3]) == 2  # the best plan uses tp = 2
    assert "no tensor parallelism" not in run
    assert run.count("pipeblocks train --schedule") == 2 and run.count(" --tp 2 ") == 2  # local and torchrun
    assert run.count("--model-family gpt") == 2
    assert run.count("torchrun --nnodes 1 --nproc-per-node 8 -m pipeblocks train --schedule") == 1


def test_torchrun_command_starts_the_same_number_of_processes_on_every_node():
    report = importlib.import_module("pipeblocks.plan.report")
    plan = importlib.import_module("pipeblocks.plan.search")
    problem = _problem(1024, 160)
    chosen = plan.Evaluated(plan.Candidate("v-zb", 2, 2, 10, 1, 80), "zero3", 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, True)
    result = plan.PlanResult(problem, (chosen,), (), 0.0, 1)
    launch = next(line for line in report.commands(result) if line.startswith("torchrun"))
    assert "--nnodes 5 --nproc-per-node 8 " in launch  # 40 ranks, at most 8 per node, a tp group of 2 on one
