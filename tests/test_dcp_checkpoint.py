"""Data-parallel checkpoints (torch.distributed.checkpoint): exact resume, a different dp size, atomic steps."""
from __future__ import annotations

import json

import pytest

from pipeblocks.cli.main import main
from pipeblocks.train import sharded_checkpoint as sharded
from test_train import _train

pytestmark = pytest.mark.spawn

BASE = ["--schedule", "1f1b", "-p", "2", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq", "16",
        "--microbatch-size", "2", "--timeout", "90", "--dtype", "float64", "--quiet",
        "--lr-decay-steps", "4"]  # one learning-rate horizon for the straight run and the resumed ones


def _losses(*args: str, report) -> list[float]:
    proc = _train(*BASE, *args, "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    return [entry["loss"] for entry in json.loads(report.read_text())["losses"]]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """4 uninterrupted steps at d=2 (global batch 2 x 2 microbatches)."""
    out = tmp_path_factory.mktemp("straight")
    return _losses("-m", "2", "--dp", "2", "--sharding", "zero3", "--steps", "4", report=out / "r.json")


@pytest.mark.parametrize("policy", ["zero3", "zero1"])
def test_two_steps_then_resume_gives_the_losses_of_four_straight_steps(tmp_path, straight, policy):
    run = ["-m", "2", "--dp", "2", "--sharding", policy, "--checkpoint", str(tmp_path / "ck")]
    first = _losses(*run, "--steps", "2", report=tmp_path / "a.json")
    assert sharded.latest_sharded_step(tmp_path / "ck") == 2
    marker = sharded.read_marker(tmp_path / "ck", 2)
    assert marker["step"] == 2 and marker["world_size"] == 4
    second = _losses(*run, "--steps", "4", "--resume", report=tmp_path / "b.json")
    assert len(first) == len(second) == 2
    assert first + second == pytest.approx(straight, rel=1e-12, abs=0)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["dcp-step00000002", "dcp-step00000004"]


def test_a_checkpoint_saved_at_dp_2_resumes_at_dp_1_with_the_same_global_batch(tmp_path, straight):
    ck = str(tmp_path / "ck")
    first = _losses("-m", "2", "--dp", "2", "--sharding", "zero3", "--checkpoint", ck, "--steps", "2",
                    report=tmp_path / "a.json")
    # d=1 with m=4 trains on the same 4 microbatches per step as d=2 with m=2
    second = _losses("-m", "4", "--checkpoint", ck, "--steps", "4", "--resume", report=tmp_path / "b.json")
    assert first + second == pytest.approx(straight, rel=1e-9, abs=0)


def test_resume_ignores_an_incomplete_step_and_a_used_directory_is_refused(tmp_path, capsys):
    ck = tmp_path / "ck"
    _losses("-m", "2", "--dp", "2", "--sharding", "zero2", "--checkpoint", str(ck), "--steps", "1",
            report=tmp_path / "a.json")
    # an interrupted save: the step directory exists but its marker was never written
    (sharded.step_path(ck, 1) / sharded.MARKER).rename(tmp_path / "marker")
    assert sharded.latest_sharded_step(ck) is None
    args = ["train", *BASE, "-m", "2", "--dp", "2", "--sharding", "zero2", "--checkpoint", str(ck)]
    assert main([*args, "--steps", "3", "--resume"]) == 2
    assert "no complete data-parallel checkpoint" in capsys.readouterr().err
    assert main([*args, "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "already holds data-parallel checkpoints" in err and "--overwrite" in err


def test_resume_refuses_a_different_global_batch(tmp_path, capsys):
    ck = tmp_path / "ck"
    _losses("-m", "2", "--dp", "2", "--sharding", "replicate", "--checkpoint", str(ck), "--steps", "1",
            report=tmp_path / "a.json")
    assert main(["train", *BASE, "-m", "2", "--checkpoint", str(ck), "--steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "global_batch: checkpoint 8, now 4" in err


def test_portable_meta_keeps_the_global_batch_and_drops_the_mesh():
    a = sharded.portable_meta({"m": 2, "microbatch_size": 2, "dp": 2, "sharding": ["zero3"], "lr": 1.0})
    b = sharded.portable_meta({"m": 4, "microbatch_size": 2, "lr": 1.0})
    assert a == b == {"microbatch_size": 2, "lr": 1.0, "global_batch": 8}
