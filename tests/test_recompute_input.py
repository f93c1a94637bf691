"""Bad input for elastic groups, --recompute and --gpu-memory, on `simulate` and `train`:
one clear line, exit status 2, before anything runs (issue: PipeMesh, bad input)."""
from __future__ import annotations

import pytest

from pipeblocks.cli.main import main

TRAIN = ("train", "-p", "2", "-m", "4", "--layers", "4", "--dry-run")


@pytest.mark.parametrize("command", ["simulate", "train"])
@pytest.mark.parametrize("args, message", [
    (("--forward-groups", "2,3"), "--forward-groups 2,3 sums to 5, but a step has m=4 microbatches"),
    (("--forward-groups", "2,2", "--backward-groups", "3"), "--backward-groups 3 sums to 3"),
    (("--forward-groups", "4,0"), "every group needs 1 or more microbatches, got [0]"),
    (("--forward-groups", "6,-2"), "every group needs 1 or more microbatches, got [-2]"),
    (("--recompute", "auto"), "no --gpu-memory was given: give --gpu-memory GB"),
    (("--recompute", "auto", "--gpu-memory", "1"), "raise --gpu-memory to at least 14.6"),
])
def test_bad_elastic_and_recompute_input(capsys, command, args, message):
    argv = [command, "elastic", "-p", "2", "-m", "4"] if command == "simulate" else [*TRAIN, "--schedule", "elastic"]
    code = main([*argv, "--dp", "2", "--sharding", "zero3", *args])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_train_refuses_recomputed_sequence_chunks(capsys):
    code = main([*TRAIN, "--schedule", "1f1b", "--recompute", "all", "--seq-chunks", "2"])
    _, err = capsys.readouterr()
    assert code == 2
    assert "the runtime does not recompute sequence chunks" in err and "drop --recompute" in err


def test_simulate_says_what_would_fit(capsys):
    assert main(["simulate", "elastic", "-p", "2", "-m", "4", "--dp", "2", "--sharding", "zero3",
                 "--gpu-memory", "15.5"]) == 0
    out = capsys.readouterr().out
    assert "fits memory   no (--gpu-memory 15.5)" in out
    assert "this plan needs 16.5 per rank" in out and "with every forward recomputed it needs 14.6" in out
    assert main(["simulate", "elastic", "-p", "2", "-m", "4", "--gpu-memory", "5"]) == 0
    assert "raise --gpu-memory to at least 16.6" in capsys.readouterr().out


def test_compare_shows_fits_memory_and_recompute_time(capsys):
    base = ["compare", "-p", "2", "-m", "4", "--schedules", "1f1b,1f1b-r,elastic", "--dp", "2", "--sharding", "zero3",
            "--gpu-memory", "15.5"]
    assert main(base) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("schedule"))
    assert "recomp" in header and "fits" in header
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["1f1b"], ["1f1b-r"])}
    assert header.split()[-5:] == ["recomp", "fits", "peak", "per", "rank"]
    recomp, fits = -4, -3  # before the p=2 peaks per rank
    assert rows["1f1b-r"][recomp] == "4" and rows["1f1b-r"][fits] == "yes"
    assert rows["1f1b"][recomp] == "0" and rows["1f1b"][fits] == "no"
    import json

    assert main([*base, "--json"]) == 0
    data = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["schedules"]}
    assert data["1f1b-r"]["fits_memory"] is True and data["1f1b-r"]["recompute_time"] == [4.0, 4.0]
    assert data["1f1b"]["fits_memory"] is False


def test_report_replays_the_recomputation():
    """The train report's prediction recomputes the pairs the run did, each forward keeping
    the profiled input share; recomputation events in the measured timeline are not passes."""
    from pipeblocks import schedules
    from pipeblocks.core.lowering.recompute import all_pairs
    from pipeblocks.core.simulator.simulate import simulate
    from pipeblocks.runtime.memory import StageMemory
    from pipeblocks.train.report import RankResult, build_report

    schedule = schedules.get("1f1b")(p=2, m=4)
    measured = simulate(schedule, recompute=all_pairs(schedule))  # has Recompute events
    results = [RankResult(r, (r,), ((0, 1.0),) if r == 1 else (), ((0, 0.0, 1.0),), 10,
                          ((0, measured),) if r == 0 else ()) for r in range(2)]
    memory = [StageMemory(m_b=1000, m_w=1000, m_in=100) for _ in range(2)]
    plain = build_report(schedule, results, memory, warmup=0).data
    recomputed = build_report(schedule, results, memory, warmup=0, recompute=all_pairs(schedule)).data
    assert [r["peak_activation_bytes_predicted"] for r in plain["ranks"]] == [2000, 1000]
    # rank 0: two inputs kept (10% each) and one microbatch rebuilt
    assert [r["peak_activation_bytes_predicted"] for r in recomputed["ranks"]] == pytest.approx([1100, 1000])
    assert recomputed["stages"][0]["f_s"] == plain["stages"][0]["f_s"] == 1.0
