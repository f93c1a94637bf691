"""`train --async MODE` and its settings: bad input is one clear line and exit status 2,
before any process starts (these tests run in the fast tier, which refuses processes)."""
from __future__ import annotations

import pytest

from pipeblocks.cli.main import main
from pipeblocks.schedules import get
from pipeblocks.core.lowering.async_mode import AsyncMode
from pipeblocks.train.config import ModelChoice, ScheduleSpec, TrainConfig


@pytest.mark.parametrize(
    "args, message",
    [
        (["--async", "naive", "--schedule", "gpipe"], "schedule 'gpipe' has no asynchronous form; the schedules that "
                                                      "have one are 1f1b"),
        (["--async", "naive", "--schedule", "zb-h1"], "use --schedule 1f1b"),
        (["--async", "naive", "--dp", "2"], "--async with --dp 2 or --sharding is not supported yet"),
        (["--async", "naive", "--sharding", "zero1"], "is not supported yet: use --dp 1 --sharding replicate"),
        (["--async", "naive", "--seq-chunks", "2"], "--async with sequence chunks is not supported"),
        (["--async", "naive", "--recompute", "all"], "drop --recompute"),
        (["--async", "pipemare", "--lr-warmup-steps", "-1"], "lr_warmup_steps (K) must be an integer >= 0"),
        (["--async", "pipemare", "--discrepancy-decay", "1.5"], "discrepancy_decay (D) must be a number in (0, 1]"),
        (["--async", "pipemare", "--discrepancy-decay", "-0.1"], "must be a number in (0, 1]"),
        (["--async", "pipemare", "--discrepancy-decay", "nan"], "must be a number in (0, 1]"),
        (["--async", "pipemare", "--discrepancy-decay", "inf"], "must be a number in (0, 1]"),
        (["--async", "naive", "--sync-warmup-steps", "-1"], "sync_warmup_steps must be an integer >= 0"),
        (["--async", "naive", "--steps", "4", "--sync-warmup-steps", "4"],
         "--sync-warmup-steps 4 leaves no asynchronous step of --steps 4: give W < steps"),
        (["--async", "naive", "--lr-warmup-steps", "3"], "mode 'naive' takes no lr_warmup_steps"),
        (["--lr-warmup-steps", "3"], "--lr-warmup-steps set(s) an asynchronous mode: add --async MODE"),
        (["--async", "fast"], "argument --async: invalid choice: 'fast'"),
        (["--async", "naive", "--clip-grad", "1"], "--async with --clip-grad is not supported yet"),
        (["--async", "naive", "--dry-run"], "--async with --dry-run is not supported yet"),
        (["--async", "naive", "--verify", "--emulate", "1,1,1"], "drop --emulate"),
    ],
)
def test_bad_async_input_is_a_clear_error(args, message, capsys):
    assert main(["train", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err, captured.err
    assert "training" not in captured.out


def test_simulate_refuses_async_settings_without_async(capsys):
    assert main(["simulate", "1f1b", "--discrepancy-decay", "0.5"]) == 2
    assert "add --async MODE" in capsys.readouterr().err


def test_simulate_weight_memory_follows_the_discrepancy_decay(capsys):
    import json

    assert main(["simulate", "1f1b", "-p", "3", "-m", "1", "--async", "pipemare", "--json"]) == 0
    with_t2 = json.loads(capsys.readouterr().out)["weight_memory"]
    assert main(["simulate", "1f1b", "-p", "3", "-m", "1", "--async", "pipemare", "--discrepancy-decay", "1",
                 "--json"]) == 0
    without = json.loads(capsys.readouterr().out)["weight_memory"]
    assert with_t2 == [2, 2, 1] and without == [1, 1, 1]


def test_config_refuses_a_warm_up_as_long_as_the_run():
    with pytest.raises(ValueError, match="leaves no asynchronous step"):
        TrainConfig(schedule=ScheduleSpec(get("1f1b")(p=2, m=2)), model=ModelChoice(), steps=3,
                    async_mode=AsyncMode("naive", sync_warmup_steps=3))
