"""The torchrun path: environment rendezvous, one process per rank, the example script."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawn

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchrun_gpt.py"


def test_example_trains_under_torchrun(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLE), "--schedule", "zb-v", "--microbatches", "4", "--steps", "3"],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 3
    assert losses[0] == pytest.approx(5.5519, abs=1e-3)  # the untrained byte-level model: ~ln(256)
    assert losses[-1] < losses[0]


def test_sigterm_under_torchrun_stops_every_rank_after_one_step_and_saves(tmp_path):
    """torchrun sends SIGTERM to every worker when it is stopped; the example ends after one
    common step, saves it on every rank, and leaves no process behind."""
    import signal
    import threading
    import time

    from pipeblocks.train.checkpoint import latest_step

    from _processes import descendants, kill_all, survivors

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
         "--schedule", "1f1b", "--microbatches", "2", "--microbatch-size", "1", "--steps", "100000",
         "--checkpoint", str(tmp_path / "ck")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe from filling
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("step 2/") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, lines[-5:]
            time.sleep(0.05)
        seen.update(descendants(proc.pid))
        assert len(seen) >= 2, seen
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        assert survivors(seen, 10) == []
        time.sleep(0.2)  # the reader thread catches up
        stops = [tuple(map(int, m)) for m in re.findall(r"rank (\d): stopped by SIGTERM to a rank after step (\d+)",
                                                         "".join(lines))]
        assert sorted(rank for rank, _ in stops) == [0, 1], lines[-6:]
        steps = {step for _, step in stops}
        assert len(steps) == 1, stops  # the same step on every rank
        assert latest_step(tmp_path / "ck", world_size=2) == steps.pop()
    finally:
        proc.kill()
        kill_all(seen)
        proc.wait(10)


def _torchrun_train(tmp_path, *options, nproc: int = 2, timeout: int = 240):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         "-m", "pipeblocks", "train", *options],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
    )


def test_pipeblocks_train_runs_under_torchrun_with_the_local_options(tmp_path):
    """`torchrun -m pipeblocks train` with the options of a local run: one rank prints the
    progress, rank 0 alone the header and the report (written once)."""
    proc = _torchrun_train(tmp_path, "--schedule", "zb-v", "-p", "2", "-m", "4", "--steps", "3", "--layers", "4",
                           "--hidden", "32", "--model-family", "llama", "--kv-heads", "2", "--precision", "bf16-mixed",
                           "--report", "run.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("training 4-layer Llama") == 1 and out.count("iteration time") == 1, out
    assert len(re.findall(r"^step +\d+/3  loss", out, flags=re.M)) == 3, out
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["precision"] == "bf16-mixed" and report["model"]["family"] == "llama"


def test_verify_under_torchrun_and_a_world_that_does_not_fit(tmp_path):
    proc = _torchrun_train(tmp_path, "--schedule", "v-half", "-p", "2", "-m", "4", "--layers", "4", "--hidden", "16",
                           "--seq", "16", "--precision", "fp64", "--verify")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("tolerance 1e-10: OK") == 1, proc.stdout
    bad = _torchrun_train(tmp_path, "--schedule", "1f1b", "-p", "4", "--steps", "1")
    assert bad.returncode != 0
    said = [line for line in bad.stderr.splitlines() if line.startswith("pipeblocks train: error:")]
    assert len(said) == 1 and "needs p x dp = 4 processes but torchrun started 2" in said[0], bad.stderr[-2000:]
