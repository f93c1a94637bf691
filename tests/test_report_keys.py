"""The synchronous and the asynchronous `--report` carry the same top-level keys with the same
meaning (`train.report_keys.SHARED_KEYS`): one tool reads both."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeblocks.train.asynchronous.report import _shared
from pipeblocks.train.report_keys import SHARED_KEYS, shared_figures

SRC = str(Path(__file__).resolve().parents[1] / "src")
STEPS = 6
TINY = ["-p", "2", "-m", "2", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq", "16", "--microbatch-size", "2",
        "--steps", str(STEPS), "--quiet", "--device", "cpu", "--timeout", "90"]
TOKENS_PER_STEP = 2 * 2 * 16  # m x microbatch x seq


def _report(tmp_path, name: str, *args: str) -> dict:
    path = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pipeblocks.cli.main", "train", *TINY, *args, "--report", str(path)],
                          env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(path.read_text())


def _kind(value) -> str:
    """The JSON type a tool sees: a number, a list of {step: int, loss: number}, ..."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, list):
        return "losses" if all(isinstance(x["step"], int) and isinstance(x["loss"], float) for x in value) else "list"
    return type(value).__name__


@pytest.mark.spawn
def test_both_reports_carry_the_shared_keys_with_one_meaning(tmp_path):
    sync = _report(tmp_path, "sync", "--schedule", "1f1b")
    asynchronous = _report(tmp_path, "async", "--async", "pipedream")
    a, b = shared_figures(sync), shared_figures(asynchronous)
    assert {key: _kind(value) for key, value in a.items()} == {key: _kind(value) for key, value in b.items()}
    assert isinstance(a["steps_timed"], int) and isinstance(b["steps_timed"], int)
    for figures in (a, b):
        assert figures["iteration_time_measured_s"] > 0 and figures["iteration_time_simulated_s"] > 0
        assert 0 <= figures["bubble_ratio_measured"] < 1 and 0 <= figures["bubble_ratio_simulated"] < 1
        assert figures["step_time_s"] > 0 and figures["t_comm_s"] >= 0 and figures["steps_timed"] >= 1
        # tokens per wall second: one step's tokens over the step's wall time
        assert figures["tokens_per_s_measured"] == pytest.approx(TOKENS_PER_STEP / figures["step_time_s"])
        # every step's loss, 1-based
        assert [x["step"] for x in figures["losses"]] == list(range(1, STEPS + 1))
    # the asynchronous run has no flush: an iteration is the steady state's step, kept under its old names too
    steady = asynchronous["steady_state"]
    assert b["iteration_time_measured_s"] == steady["step_time_s_measured"] == b["step_time_s"]
    assert b["iteration_time_simulated_s"] == steady["step_time_s_simulated"]
    assert (b["bubble_ratio_measured"], b["bubble_ratio_simulated"]) == (steady["bubble_measured"],
                                                                         steady["bubble_simulated"])
    assert b["tokens_per_s_measured"] == steady["tokens_per_s_measured"]
    # the synchronous iteration leaves the optimizer step out, the whole step has it
    assert a["iteration_time_measured_s"] <= a["step_time_s"]


def test_without_a_steady_state_the_asynchronous_figures_are_null():
    assert set(_shared(None)) | {"losses"} == set(SHARED_KEYS)
    assert all(value is None for value in _shared(None).values())


def test_a_report_without_the_shared_keys_names_them():
    with pytest.raises(KeyError, match="the report lacks tokens_per_s_measured, steps_timed"):
        shared_figures({key: 0 for key in SHARED_KEYS if key not in ("tokens_per_s_measured", "steps_timed")})
