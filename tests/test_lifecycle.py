"""A run's life cycle under `pipeblocks train`: a progressing run outlives --timeout, a
signal to the launcher stops every process (and saves when asked), no worker outlives a
killed launcher, and a killed worker is named as the cause.

Processes are found through /proc (the launcher's descendants, recorded while it runs) and
every one of them is killed in a `finally`, so a failing test leaves nothing behind.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _lifecycle_cases import beating_worker
from _processes import cmdline, descendants, kill_all, survivors

from pipeblocks.runtime import spawn
from pipeblocks.train.checkpoint import latest_step

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc"),
    pytest.mark.spawn,
]

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["--schedule", "1f1b", "-p", "2", "-m", "2", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq", "16",
        "--microbatch-size", "2"]
GONE_WITHIN_S = 10.0


class Run:
    """`pipeblocks train ARGS` in the background; stdout collected line by line."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeblocks.cli.main", "train", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.errors: list[str] = []
        self.seen: dict[int, str] = {}  # pid -> start time: every process of the run, for the cleanup
        # read in threads: a worker that outlives the launcher keeps the pipes open
        for stream, into in ((self.proc.stdout, self.lines), (self.proc.stderr, self.errors)):
            threading.Thread(target=lambda s=stream, i=into: i.extend(s), daemon=True).start()

    @property
    def stderr(self) -> str:
        return "".join(self.errors)

    def wait_for_step(self, step: int, limit_s: float = 90.0) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if any(re.match(rf"step +{step}/", line) for line in self.lines):
                return
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended before step {step}: {self.stderr[-2000:]}")
            time.sleep(0.05)
        pytest.fail(f"no step {step} within {limit_s} s: {self.lines[-3:]}")

    def descendants(self) -> dict[int, str]:
        found = descendants(self.proc.pid)
        self.seen.update(found)
        return found

    def workers(self) -> list[int]:
        """The rank processes (multiprocessing children), in start order."""
        pids = [pid for pid in self.descendants() if "--multiprocessing-fork" in cmdline(pid)]
        return sorted(pids)  # pids grow in start order (barring a wrap-around)

    def finish(self, limit_s: float) -> int:
        code = self.proc.wait(limit_s)
        time.sleep(0.2)  # the reader threads catch up
        return code

    def cleanup(self) -> None:
        self.proc.kill()
        kill_all(self.seen)
        self.proc.wait(10)


def test_spawn_times_out_a_rank_without_progress_not_a_run_with_it():
    # 8 reports 0.4 s apart: 3 s or more in all, past timeout_s=2, with progress all along
    assert spawn(beating_worker, 2, args=(8, 0.4, None), timeout_s=2, threads_per_rank=1) == [("done", 8)] * 2
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank [01] made no progress for 2 s \(after step 3\)"):
        spawn(beating_worker, 2, args=(8, 0.1, 3), timeout_s=2, threads_per_rank=1)
    assert time.monotonic() - started < 60  # not the 600 s the ranks would hang


def test_a_run_that_makes_progress_outlives_its_timeout():
    # about 0.9 s a step (3 slots of 300 ms), 7 steps: the steps alone last well past
    # --timeout 4, but no step or wait takes 4 s
    run = Run(*TINY, "--steps", "7", "--emulate", "100,100,100", "--timeout", "4")
    try:
        assert run.finish(150) == 0, run.stderr[-3000:]
        step_ms = [float(ms) for ms in re.findall(r"^step +\d+/7 .* ([\d.]+) ms$", "".join(run.lines), re.MULTILINE)]
        assert len(step_ms) == 7, run.lines
        assert sum(step_ms) > 5000, f"the steps took {sum(step_ms):.0f} ms: too short to show anything"
    finally:
        run.cleanup()


def test_sigterm_to_the_launcher_stops_every_process_and_saves_one_step(tmp_path):
    ckpt = tmp_path / "ck"
    run = Run(*TINY, "--steps", "100000", "--emulate", "5,5,5", "--checkpoint", str(ckpt))
    try:
        run.wait_for_step(3)
        processes = run.descendants()
        assert len(processes) >= 2, processes
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish(GONE_WITHIN_S) == 128 + signal.SIGTERM, run.stderr[-3000:]
        assert survivors(processes, GONE_WITHIN_S) == []
        assert "stopped by SIGTERM to the launcher" in run.stderr, run.stderr[-3000:]
        step = latest_step(ckpt, world_size=2)
        assert step is not None and step >= 3, sorted(p.name for p in ckpt.iterdir())
        # both ranks saved the same step: the stop was agreed, not wherever each one was
        assert {p.name for p in ckpt.glob("*.pt")} >= {f"rank0-step{step:08d}.pt", f"rank1-step{step:08d}.pt"}
        assert f"every rank has step {step}" in run.stderr
    finally:
        run.cleanup()


def test_sigkill_of_the_launcher_leaves_no_worker_behind(tmp_path):
    ckpt = tmp_path / "ck"
    run = Run(*TINY, "--steps", "100000", "--emulate", "5,5,5", "--checkpoint", str(ckpt))
    try:
        run.wait_for_step(3)
        processes = run.descendants()
        assert len(processes) >= 2, processes
        run.proc.kill()
        run.finish(GONE_WITHIN_S)
        assert survivors(processes, GONE_WITHIN_S) == []
        # the orphaned ranks agreed on a step and saved it before ending
        step = latest_step(ckpt, world_size=2)
        assert step is not None and step >= 3, sorted(p.name for p in ckpt.iterdir()) if ckpt.exists() else None
    finally:
        run.cleanup()


def test_a_killed_worker_is_named_with_its_signal_and_the_survivor_saves(tmp_path):
    ckpt = tmp_path / "ck"
    run = Run(*TINY, "--steps", "100000", "--emulate", "5,5,5", "--checkpoint", str(ckpt))
    try:
        run.wait_for_step(3)
        workers = run.workers()
        assert len(workers) == 2, workers
        victim = workers[1]  # rank 1 (started second)
        os.kill(victim, signal.SIGKILL)
        assert run.finish(60) == 1, run.stderr[-3000:]
        assert re.search(rf"rank 1 \(pid {victim}\) was killed by SIGKILL; rank 0 then failed: ", run.stderr), \
            run.stderr[-3000:]
        # rank 0 saved its last completed step on the way out (rank 1 could not: no common step)
        saved = re.search(r"rank 0: saved step (\d+) to .* on the way out", run.stderr)
        assert saved and int(saved.group(1)) >= 3, run.stderr[-3000:]
        assert (ckpt / f"rank0-step{int(saved.group(1)):08d}.pt").exists()
    finally:
        run.cleanup()
