"""Asynchronous runs that report and survive: a run stopped by SIGTERM drains, saves and
resumes; the resumed run equals a run that drained at the same step and continued; the
report has every step's loss, the delays and the steady state beside the simulator's; a
resume with another mode or p is one line before launch."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")

# long enough that the SIGTERM sent when step 2 is printed lands before the run ends, even when a
# loaded machine hands the launcher the step lines late
STEPS = 30
ASYNC = ["--async", "pipemare", "--lr-warmup-steps", "4", "--sync-warmup-steps", "1", "-p", "2", "-m", "2",
         "--layers", "2", "--hidden", "16", "--heads", "2", "--seq", "16", "--microbatch-size", "2", "--steps", str(STEPS),
         "--timeout", "90"]


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeblocks.cli.main", "train", *ASYNC, *args]


def _env() -> dict:
    import os

    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(_command(*args), env=_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _stopped_by_sigterm(directory) -> tuple[int, dict[int, float], str]:
    """Start a run, SIGTERM the launcher once step 2 is printed: (the drained step, the
    losses printed, stderr)."""
    proc = subprocess.Popen(_command("--checkpoint", str(directory)), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    printed = []
    for line in proc.stdout:
        printed.append(line)
        if line.startswith("step     2/"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    drained = int(re.search(r"every rank has drained step (\d+) in", err).group(1))
    losses = {int(s): float(x) for s, x in re.findall(rf"^step +(\d+)/{STEPS} +loss +([\d.]+)", "".join(printed) + out,
                                                      re.M)}
    return drained, losses, err


@pytest.mark.spawn
def test_sigterm_drains_saves_and_the_resumed_run_equals_a_run_drained_there(tmp_path):
    drained, before, err = _stopped_by_sigterm(tmp_path / "stopped")
    assert 2 <= drained < STEPS and sorted(before) == list(range(1, drained + 1)), (drained, before)
    assert f"drained at step {drained} (SIGTERM to the launcher)" in err
    # the reference drains at the same step (a save point) and goes on; the resumed run plans the same
    # save points from there, so both run the same Programs after the drain
    every = ["--save-every", str(drained)]
    reference = _run("--checkpoint", str(tmp_path / "ref"), *every, "--report", str(tmp_path / "ref.json"))
    resumed = _run("--checkpoint", str(tmp_path / "stopped"), "--resume", *every, "--report",
                   str(tmp_path / "resumed.json"), "--metrics", str(tmp_path / "m.jsonl"))
    ref = json.loads((tmp_path / "ref.json").read_text())
    got = json.loads((tmp_path / "resumed.json").read_text())
    assert [x["step"] for x in got["losses"]] == list(range(drained + 1, STEPS + 1))
    assert [x["loss"] for x in got["losses"]] == [x["loss"] for x in ref["losses"]][drained:]  # exactly
    assert [round(x["loss"], 4) for x in ref["losses"][:drained]] == [before[k] for k in range(1, drained + 1)]
    assert not re.search(rf"^step +{drained}/{STEPS}", resumed.stdout, re.M)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(drained + 1, STEPS + 1))
    # the report: every step's loss, the delays per stage, the steady state measured beside simulated
    assert [x["synchronous"] for x in ref["losses"]] == [True] + [False] * (STEPS - 1)
    assert [d["stage"] for d in ref["delays"]] == [0, 1] and ref["delays"][1]["max"] == 0
    assert ref["delays"][0]["max"] == 1 and sum(ref["delays"][0]["counts"].values()) == 2 * (STEPS - 1)
    steady = ref["steady_state"]
    assert steady is not None and steady["steps"] >= 3
    for key in ("step_time_s_measured", "step_time_s_simulated", "tokens_per_s_measured", "tokens_per_s_simulated"):
        assert steady[key] > 0, key
    assert 0 <= steady["bubble_measured"] < 1 and 0 <= steady["bubble_simulated"] < 1
    assert ref["saved"] == sorted({k for k in range(drained, STEPS + 1, drained)} | {STEPS})[-len(ref["saved"]):]
    assert "steady state over steps" in reference.stdout and "bubble     measured" in reference.stdout


@pytest.mark.torch
@pytest.mark.parametrize("args, message", [
    (["--async", "naive"], "was written by --async pipemare with p=2 (W=1, K=4, D=0.1); this run is --async "
                           "naive with p=2"),
    (["--async", "pipemare", "--lr-warmup-steps", "4", "--sync-warmup-steps", "1", "-p", "3", "--layers", "3"],
     "this run is --async pipemare with p=3"),
    ([], "this run is synchronous training with p=2"),
])
def test_resuming_an_asynchronous_checkpoint_as_another_run_is_one_line(args, message, tmp_path, capsys):
    import torch

    from pipeblocks.cli.main import main
    from pipeblocks.core.lowering.async_mode import AsyncMode
    from pipeblocks.train import checkpoint as ckpt

    mode = AsyncMode("pipemare", sync_warmup_steps=1, lr_warmup_steps=4)
    meta = {"p": 2, "async": mode.describe()}
    for rank in (0, 1):
        ckpt.save_rank(tmp_path, rank=rank, step=3, stages={rank: torch.nn.Linear(1, 1)},
                       optimizer=torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1), meta=meta)
    base = ["train", "--schedule", "1f1b", "-p", "2", "-m", "2", "--layers", "2", "--steps", "10",
            "--checkpoint", str(tmp_path), "--resume"]
    assert main([*base, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
