"""The loop users expect (pure Python and in-process parts): the learning-rate schedule, the
held-out split, the metrics file, and bad input to them as one line before launch."""
from __future__ import annotations

import json
import math

import pytest

from pipeblocks.cli.main import main
from pipeblocks.train.lr_schedule import LRSchedule, resolve_schedule


def test_warm_up_then_cosine_linear_or_constant():
    cos = LRSchedule("cosine", lr=1.0, warmup_steps=4, min_lr=0.1, total_steps=14)
    assert [cos.rate(t) for t in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])  # up to the peak at step 4
    assert cos.rate(4) == 1.0 and cos.rate(13) == pytest.approx(0.1)
    assert cos.rate(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 9)))
    assert cos.rate(50) == pytest.approx(0.1)  # past the schedule's end: its last rate
    lin = LRSchedule("linear", lr=1.0, warmup_steps=0, min_lr=0.0, total_steps=5)
    assert [lin.rate(t) for t in range(6)] == pytest.approx([1, 0.75, 0.5, 0.25, 0, 0])
    const = LRSchedule("constant", lr=0.5, warmup_steps=1, total_steps=3)
    assert [const.rate(t) for t in range(3)] == [0.25, 0.5, 0.5]
    assert LRSchedule.from_json(json.loads(json.dumps(cos.to_json()))) == cos
    assert cos.factor(0) == pytest.approx(0.2)


def test_a_fresh_run_defaults_to_cosine_with_a_tenth_warm_up_and_a_resume_continues_its_schedule():
    fresh = resolve_schedule(None, lr=3e-3, warmup_steps=None, min_lr=None, steps=40)
    assert (fresh.kind, fresh.warmup_steps, fresh.min_lr, fresh.total_steps) == ("cosine", 4, pytest.approx(3e-4), 40)
    assert resolve_schedule(None, lr=3e-3, warmup_steps=None, min_lr=None, steps=4000).warmup_steps == 100
    planned = resolve_schedule(None, lr=3e-3, warmup_steps=None, min_lr=None, steps=20, decay_steps=40)
    assert planned == fresh  # a run of 20 steps made to be continued to 40
    # resumed with more --steps: the checkpoint's schedule, horizon included, goes on unchanged
    assert resolve_schedule(None, lr=None, warmup_steps=None, min_lr=None, steps=80, saved=fresh.to_json()) == fresh
    with pytest.raises(ValueError, match=r"--warmup-steps 9 \(the checkpoint's: 4\) differ"):
        resolve_schedule(None, lr=None, warmup_steps=9, min_lr=None, steps=40, saved=fresh.to_json())


@pytest.mark.parametrize("args, message", [
    (["--steps", "5", "--warmup-steps", "5"], "--warmup-steps 5 leaves no step at the peak rate of a schedule of 5"),
    (["--lr", "nan"], "argument --lr"),
    (["--lr", "-1"], "argument --lr"),
    (["--min-lr", "inf"], "argument --min-lr"),
    (["--min-lr", "-0.1"], "argument --min-lr"),
    (["--lr", "0.01", "--min-lr", "0.1"], "--min-lr 0.1 is above --lr 0.01"),
    (["--lr-schedule", "constant", "--min-lr", "0.001"], "has no effect: drop --min-lr"),
    (["--eval-every", "5", "--held-out", "0"], "no data is held out to evaluate on"),
    (["--eval-every", "5", "--data", "SMALL"], "fewer than one window of 65: raise --held-out"),
    (["--eval-every", "2", "--emulate", "1,1,1"], "emulated compute learns nothing to evaluate"),
    (["--held-out", "0.9"], "--held-out 0.9: give a share of the data in 0 .. 0.5"),
    (["--lr-schedule", "step"], "argument --lr-schedule: invalid choice"),
])
@pytest.mark.torch  # prepare loads the corpus (a tensor) before some of these checks
def test_bad_loop_input_is_one_line_before_launch(args, message, tmp_path, capsys):
    (tmp_path / "small.txt").write_text("x" * 400)  # 5% of it: 20 tokens, less than a window
    args = [str(tmp_path / "small.txt") if a == "SMALL" else a for a in args]
    assert main(["train", "--schedule", "1f1b", "-p", "2", "-m", "2", "--layers", "2", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err, captured.err
    assert len(captured.err.strip().splitlines()) <= 3 and "training" not in captured.out


@pytest.mark.torch
def test_held_out_windows_never_train_and_the_evaluation_set_is_fixed():
    from pipeblocks.data import TokenWindows

    data = TokenWindows.load(None, seq=16)
    train, held = data.split(0.05)
    cut = train.tokens.numel()
    assert cut == data.tokens.numel() - round(data.tokens.numel() * 0.05) and held.tokens.numel() > 17
    assert train.num_windows == cut - 16  # a training window is seq+1 tokens inside the first `cut`
    for step in range(50):
        x, y = train.batch(step, 8, seed=3)
        assert x.shape == (8, 16)
    a, b = held.eval_batch(6), held.eval_batch(6)
    assert (a[0] == b[0]).all() and (a[0][0] == held.tokens[:16]).all()
    assert (a[1][-1] == held.tokens[-16:]).all()  # evenly spaced, first to last window
    assert data.split(0.0) == (data, None)


def test_the_metrics_file_has_one_row_of_the_same_keys_per_step(tmp_path):
    from pipeblocks.train.metrics import FIELDS, MetricsWriter, read_metrics

    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(str(path), resume=False)
    writer.write(step=1, loss=5.5, lr=1e-3, step_time_s=0.5, tokens=1024, rank=1, activation_bytes=10)
    writer.write(step=2, loss=float("nan"), lr=2e-3, step_time_s=0.25, tokens=1024, rank=1, eval_loss=5.0)
    writer.close()
    MetricsWriter(str(path), resume=True).write(step=3, loss=4.0, lr=1e-3, step_time_s=1.0, tokens=1, rank=1)
    rows = read_metrics(str(path))
    assert [tuple(row) for row in rows] == [FIELDS] * 3
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["loss"] is None and rows[1]["eval_loss"] == 5.0
    assert rows[0]["tokens_per_s"] == 2048 and "NaN" not in path.read_text()
