"""`train --async MODE --eval-every N`: the held-out loss after every N-th step and the last,
printed, in `--metrics` and in the report's `eval_losses`, as in a synchronous run."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeblocks.train.metrics import read_metrics

SRC = str(Path(__file__).resolve().parents[1] / "src")
STEPS = 5
ARGS = ["--async", "pipemare", "--sync-warmup-steps", "1", "-p", "2", "-m", "2", "--layers", "2", "--hidden", "16",
        "--heads", "2", "--seq", "16", "--microbatch-size", "2", "--steps", str(STEPS), "--eval-every", "2",
        "--timeout", "60"]


@pytest.mark.spawn
def test_async_run_evaluates_every_n_steps_and_the_last(tmp_path):
    metrics = tmp_path / "run.jsonl"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pipeblocks.cli.main", "train", *ARGS, "--metrics", str(metrics),
                           "--report", str(tmp_path / "report.json")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = {int(k): float(v) for k, v in re.findall(rf"^eval +(\d+)/{STEPS} +held-out loss +([\d.]+)", proc.stdout,
                                                       re.M)}
    assert sorted(printed) == [2, 4, 5], proc.stdout
    rows = read_metrics(str(metrics))
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    written = {row["step"]: row["eval_loss"] for row in rows if row["eval_loss"] is not None}
    assert sorted(written) == [2, 4, 5] and all(math.isfinite(v) for v in written.values())
    assert all(abs(written[k] - printed[k]) < 1e-4 for k in written)
    reported = json.loads((tmp_path / "report.json").read_text())["eval_losses"]
    assert [(e["step"], e["loss"]) for e in reported] == sorted(written.items())

