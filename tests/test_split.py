"""--split: explicit layer counts per stage and --split auto (the simulator's choice), in the
analytic model and on the command line; the errors before anything starts."""
from __future__ import annotations

import dataclasses

import pytest

from pipeblocks.cli.main import main
from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.core.cost.split import check_split, parse_split, stage_layers
from pipeblocks.sim.analytic import HARDWARE, MODELS, head_flops, layer_flops, transformer_costs
from pipeblocks.resolve.build import build, choose_split_for
from pipeblocks.resolve.split_auto import balanced_counts, choose_split


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- parsing and checking -------------------------------------------------------------------

def test_parse_split():
    assert parse_split("3,4,4,3") == (3, 4, 4, 3)
    assert parse_split(" auto ") == "auto" and parse_split(None) is None
    with pytest.raises(ValueError, match="as integers in stage order"):
        parse_split("3,four")
    with pytest.raises(ValueError, match="stage 1 0 layers"):
        parse_split("3,0,4")


def test_check_split_names_the_numbers():
    assert check_split((3, 4, 4, 3), layers=14, num_stages=4, p=4) == (3, 4, 4, 3)
    with pytest.raises(ValueError, match=r"sums to 13 layers but the model has 14.*even split is 3,4,4,3"):
        check_split((3, 4, 3, 3), layers=14, num_stages=4)
    with pytest.raises(ValueError, match=r"gives 4 counts but the pipeline has 8 stages \(p=4 ranks x v=2 chunks"):
        check_split((3, 4, 4, 3), layers=14, num_stages=8, p=4)
    with pytest.raises(ValueError, match="stage 2 0 layers"):
        check_split((7, 7, 0, 0), layers=14, num_stages=4)
    assert stage_layers(10, 4) == (2, 3, 3, 2) and stage_layers(10, 4, (1, 4, 4, 1)) == (1, 4, 4, 1)


def test_bad_split_on_the_command_line_is_one_line(capsys):
    for argv, words in [
        (("--split", "8,8,8"), "gives 3 counts but the pipeline has 4 stages"),
        (("--split", "9,9,9,9"), "sums to 36 layers but the model has 32"),
        (("--split", "16,16,0,0"), "every stage needs at least one layer"),
        (("-v", "2", "--split", "8,8,8,8"), "8 stages (p=4 ranks x v=2 chunks per rank)"),
    ]:
        name = "interleaved-1f1b" if "-v" in argv else "1f1b"
        code, out, err = run_cli(capsys, "simulate", name, "-p", "4", "-m", "8", "--model", "llama-3-8b", *argv)
        assert code == 2 and out == "" and words in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(capsys, "simulate", "1f1b", "-p", "4", "--split", "2,2,2,2")
    assert code == 2 and "--model" in err  # unit costs know no layers


# ---- the analytic model prices the stages by their counts ----------------------------------

def test_each_stage_is_priced_by_its_layers_with_the_embedding_and_the_head():
    config = dataclasses.replace(MODELS["llama-3-8b"], split=(9, 9, 8, 6))
    hw = HARDWARE["a100"]
    costs = transformer_costs(config, hw, num_stages=4, stage0_input_grad=True)
    layer = layer_flops(config)[0] / (hw.flops * hw.efficiency)
    assert costs.t_f[:3] == pytest.approx((9 * layer, 9 * layer, 8 * layer), rel=1e-12)
    # the head's GEMM and the softmax cross entropy's traffic on top of the last stage's 6 layers
    head = head_flops(config) / (hw.flops * hw.efficiency)
    softmax = config.seq * config.vocab * (2 * 2 + 4) / hw.memory_bandwidth
    assert costs.t_f[3] == pytest.approx(6 * layer + head + softmax, rel=1e-12)
    even = transformer_costs(MODELS["llama-3-8b"], hw, num_stages=4, stage0_input_grad=True)
    # memory and parameters follow the counts too: stage 0 holds one layer more than even
    assert costs.mem_b[0] > even.mem_b[0] and costs.params[3] < even.params[3]


# ---- --split auto ----------------------------------------------------------------------------

def _request(**changes):
    base = ScheduleRequest(name="1f1b", m=8, mesh=Mesh(pp=4), costs=CostSpec(model="llama-3-8b", split="auto"))
    return dataclasses.replace(base, **changes)


def test_auto_beats_the_even_split_on_a_vocabulary_heavy_model():
    chosen = choose_split_for(_request())
    choice = chosen.choice
    assert choice.even == (8, 8, 8, 8) and sum(choice.counts) == 32 and min(choice.counts) >= 1
    assert choice.step < 0.97 * choice.even_step  # the 128k head makes the even split's last stage the slowest
    built = build(_request())
    assert built.request.costs.split == choice.counts
    assert built.simulate().makespan == pytest.approx(choice.step)
    assert choice.counts[3] < 8  # the head's stage gives layers away


def test_auto_never_exceeds_the_memory_limit():
    free = choose_split_for(_request()).choice
    budget = 0.97 * free.need / 1e9  # the fastest split needs more than this
    chosen = choose_split_for(_request(gpu_memory=budget)).choice
    assert chosen.need <= budget * 1e9 and chosen.counts != free.counts
    assert chosen.step >= free.step
    # a budget nothing fits: refused, naming the numbers
    with pytest.raises(Exception, match=r"--split auto: no split fits --gpu-memory.*against 10 GB"):
        choose_split_for(_request(gpu_memory=10))


def test_the_descent_finds_the_best_split_of_a_small_case():
    """Equal to an exhaustive search over every split of 8 layers into 4 stages."""
    fixed = (0.0, 0.0, 0.5, 2.5)

    def score(counts):
        times = [f + n for f, n in zip(fixed, counts)]
        return sum(times) + 7 * max(times), float(max(counts))

    every = [(a, b, c, 8 - a - b - c) for a in range(1, 6) for b in range(1, 6) for c in range(1, 6)
             if 8 - a - b - c >= 1]
    best = min(score(c)[0] for c in every)
    assert score(choose_split(score, layers=8, num_stages=4).counts)[0] == pytest.approx(best)
    assert balanced_counts(8, 1.0, fixed) in every


def test_auto_with_unit_costs_is_refused():
    with pytest.raises(Exception, match="analytic model"):
        choose_split_for(_request(costs=CostSpec(split="auto")))


def test_simulate_and_compare_print_the_split(capsys):
    code, out, _ = run_cli(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--model", "llama-3-8b", "--split", "auto")
    assert code == 0 and "split auto" in out and "shorter than the even 8,8,8,8" in out
    code, out, _ = run_cli(capsys, "compare", "-p", "4", "-m", "8", "--model", "llama-3-8b", "--split", "9,9,8,6",
                           "--schedules", "1f1b,zb-h1")
    assert code == 0 and out.count("9,9,8,6") == 2


def test_train_refuses_a_bad_split_before_anything_starts(capsys):
    for argv, words in [
        (("--schedule", "1f1b", "--split", "1,2"), "--split 1,2 sums to 3 layers but the model has 4"),
        (("--schedule", "v-half", "--split", "1,3"), "4 stages (p=2 ranks x v=2 chunks per rank)"),
        (("--schedule", "1f1b", "--split", "4,0"), "every stage needs at least one layer"),
    ]:
        code, out, err = run_cli(capsys, "train", "-p", "2", "-m", "4", "--layers", "4", *argv)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_plan_balances_every_candidate_and_names_the_split(capsys):
    import json

    argv = ("plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu-memory", "80", "--global-batch", "32",
            "--schedules", "1f1b", "--microbatch-sizes", "1", "--tp", "1", "--jobs", "1", "--json")
    code, out, _ = run_cli(capsys, *argv)
    even = json.loads(out)
    code, out, _ = run_cli(capsys, *argv, "--split", "auto")
    auto = json.loads(out)
    assert code == 0 and auto["ranked"][0]["mfu"] > even["ranked"][0]["mfu"]
    best = auto["ranked"][0]
    assert best["pp"] == 2 and "--split 17,15 " in auto["commands"][0]  # the head's stage gives up a layer
    assert "--split" not in even["commands"][0]
    # counts for 2 stages: the meshes of other pipeline depths are left out, saying why
    code, out, _ = run_cli(capsys, *argv, "--split", "17,15")
    given = json.loads(out)
    assert {row["pp"] for row in given["ranked"]} == {2} and given["ranked"][0]["mfu"] == best["mfu"]


@pytest.mark.torch
def test_emulated_passes_sleep_each_stage_s_analytic_time():
    from pipeblocks.runtime.emulate import EmulatedCosts
    from pipeblocks.schedules import get

    built = build(dataclasses.replace(_request(), costs=CostSpec(model="llama-3-8b", split=(9, 9, 8, 6))))
    emulated = EmulatedCosts.from_costs(built.costs, built.schedule, scale=0.01)
    t = built.costs
    assert emulated.pass_ms("F", 3, 4) == pytest.approx(t.t_f[3] * 10) and emulated.pass_ms("R", 0, 4) == pytest.approx(
        t.t_f[0] * 10)
    assert emulated.pass_ms("BW", 1, 4) == pytest.approx((t.t_b[1] + t.t_w[1]) * 10)
    assert emulated.sim_costs(built.schedule).t_w == pytest.approx(tuple(w * 10 for w in t.t_w))
    with pytest.raises(ValueError, match="stage_ms has 4 stages for 8"):
        emulated.pass_ms("F", 0, 8)
    assert EmulatedCosts(1.0, 2.0, 3.0, layers=(1, 2)).sim_costs(get("1f1b")(p=2, m=2)).t_b == (2.0, 4.0)


def test_a_checkpoint_records_a_split_other_than_the_even_one():
    from pipeblocks.models import GPTConfig
    from pipeblocks.train.run import prepare

    def meta(split):
        request = ScheduleRequest(name="1f1b", m=4, mesh=Mesh(pp=2), costs=CostSpec(split=split))
        cfg, _ = prepare(request, model=GPTConfig(layers=4), steps=1)
        return cfg.meta("data")

    assert meta((1, 3))["split"] == [1, 3] and "split" not in meta((2, 2)) and "split" not in meta(None)


def test_train_split_auto_prices_the_run_s_own_model():
    """A small model with a large vocabulary: the head's stage gives layers away; with a small
    vocabulary the split stays closer to even."""
    from pipeblocks.models import GPTConfig
    from pipeblocks.train.run import prepare

    def split(vocab):
        request = ScheduleRequest(name="1f1b", m=4, mesh=Mesh(pp=2), costs=CostSpec(split="auto"))
        cfg, _ = prepare(request, model=GPTConfig(layers=6, vocab=vocab), steps=1)
        return cfg.stage_layers

    heavy, light = split(30000), split(256)
    assert sum(heavy) == 6 and heavy[1] < light[1] <= 3
