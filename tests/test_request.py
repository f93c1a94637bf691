"""One typed request per command: built once from the options, the schedule generated once,
`train` reading the same generator options as `simulate`; `train --dry-run`."""
from __future__ import annotations

import functools

import pytest

from pipeblocks.cli.main import build_parser, main
from pipeblocks.cli.common import request_from_args
from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.schedules import get, names
from pipeblocks.schedules.registry import ScheduleSpec
from pipeblocks.resolve import build as build_module
from pipeblocks.resolve.build import build


def _counting(monkeypatch, name: str) -> list[dict]:
    """Make `build` see a spec for `name` that records every generator call."""
    calls: list[dict] = []
    real = get(name)

    @functools.wraps(real.build)
    def generator(**kwargs):
        calls.append(kwargs)
        return real.build(**kwargs)

    monkeypatch.setattr(build_module, "get", lambda _: ScheduleSpec(real.name, real.summary, generator, real.v))
    return calls


@pytest.mark.parametrize("name, options", [("v-half", ()), ("zb", ()), ("zb-v", (("cost_aware", True),))])
def test_a_cost_aware_generator_is_built_once_with_analytic_costs(monkeypatch, name, options):
    calls = _counting(monkeypatch, name)
    request = ScheduleRequest(name=name, m=8, mesh=Mesh(pp=4), options=options, costs=CostSpec(model="1.5b"))
    built = build(request)
    assert len(calls) == 1
    # the analytic costs were resolved for the stage count actually built
    assert len(calls[0]["costs"].t_f) == built.schedule.num_stages
    assert built.costs is calls[0]["costs"]


def test_cli_commands_build_once(monkeypatch, capsys):
    calls = _counting(monkeypatch, "v-half")
    for command in (["simulate"], ["show"], ["export"]):
        calls.clear()
        assert main([*command, "v-half", "-p", "2", "-m", "4", "--model", "1.5b"]) == 0
        assert len(calls) == 1, command
    capsys.readouterr()


@pytest.mark.parametrize("name", names())
def test_registry_knows_the_stage_count_before_building(name):
    spec = get(name)
    for p, extra in ((2, {}), (3, {"v": 3} if spec.accepts("v") else {})):
        try:
            schedule = spec(p=p, m=8, **extra)
        except ValueError:
            continue  # (p, m) this schedule does not take
        assert spec.num_stages(p=p, m=8, **extra) == schedule.num_stages


def _parse(*argv):
    return build_parser().parse_args(list(argv))


def test_train_reads_the_same_generator_options_as_simulate():
    flags = ["-p", "2", "-m", "6", "-v", "3", "--group-size", "2", "--seq-chunks", "2", "--set", "x=1"]
    simulate = request_from_args(_parse("simulate", "interleaved-1f1b", *flags))
    train = request_from_args(_parse("train", "--schedule", "interleaved-1f1b", *flags), costs=simulate.costs)
    assert train == simulate
    assert simulate.options == (("v", 3), ("group_size", 2), ("x", 1))
    assert simulate.seq_chunks == 2 and simulate.mesh == Mesh(pp=2, dp=1)


def test_request_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="give either --model"):
        CostSpec(times="1,1,1", model="1.5b")
    with pytest.raises(ValueError, match="give 1 or more tensor-parallel ranks"):
        Mesh(pp=2, tp=0)
    assert Mesh(pp=2, dp=2, tp=2).world_size == 8
    with pytest.raises(ValueError, match=r"m must be an integer >= 1, got 0"):
        ScheduleRequest(name="1f1b", m=0, mesh=Mesh(pp=2))
    with pytest.raises(ValueError, match="needs a schedule name or a file"):
        ScheduleRequest(name=None, m=2, mesh=Mesh(pp=2))
    with pytest.raises(ValueError, match=r"mem-w-ratio must be a number in \[0, 1\]"):
        CostSpec(mem_w_ratio=float("nan"))
    request = ScheduleRequest(name="1f1b", m=4, mesh=Mesh(pp=2)).with_options(memory_limit=1.0)
    assert request.with_options(memory_limit=2.0).options == (("memory_limit", 2.0),)


def test_train_dry_run_predicts_memory_and_time_without_launching(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    from pipeblocks.models import GPT, split_stages
    from pipeblocks.models.config import GPTConfig
    from pipeblocks.train import loop, run

    def no_launch(cfg):
        raise AssertionError("--dry-run launched processes")

    monkeypatch.setattr(loop, "launch", no_launch)
    printed: list[dict] = []
    real_dry_run = run.dry_run
    monkeypatch.setattr(run, "dry_run", lambda *a, **k: printed.append(real_dry_run(*a, **k)))
    code = main(["train", "--dry-run", "--schedule", "1f1b", "-p", "2", "-m", "4", "--layers", "2", "--hidden", "32",
                 "--heads", "2", "--seq", "16", "--emulate", "2,2,1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "rank 0" in out and "F0" in out  # the text timeline
    assert "predicted iteration time 25.0 ms" in out  # (m+p-1)(F+BW) = 5 * (2 + 3) ms at one layer per stage
    assert "nothing launched" in out
    figures = printed[0]
    cfg = GPTConfig(layers=2, hidden=32, heads=2, seq=16, vocab=256)
    stages = split_stages(cfg, GPT(cfg, seed=0), 2)
    for rank, stage in enumerate(stages):
        params = sum(p.numel() for p in stage.parameters())
        row = figures["ranks"][rank]
        # fp32 AdamW: 4 + 4 + 8 bytes, and the optimistic step's spare parameter and moments 4 + 8
        assert row["static_bytes_predicted"] == 28 * params
        assert row["activation_bytes_predicted"] > 0
    # 1F1B: rank 0 holds p = 2 microbatches of its stage at the peak, rank 1 one
    assert figures["ranks"][0]["activation_bytes_predicted"] > figures["ranks"][1]["activation_bytes_predicted"]
    del torch
