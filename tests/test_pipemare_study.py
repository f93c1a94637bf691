"""benchmarks/pipemare.py --quick: the study's table has every variant with finite figures."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "pipemare.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("pipemare_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    sys.path.insert(0, str(SCRIPT.parent))  # its helpers beside it, as when run as a script
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]
        sys.path.remove(str(SCRIPT.parent))


def test_quick_study_table(study, tmp_path, capsys):
    out = tmp_path / "rows.json"
    plot = tmp_path / "curves.png"
    argv = ["--quick", "--configs", "2x1", "--lrs", "0.01", "--seeds", "0", "1", "--json", str(out), "--plot", str(plot)]
    assert study.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [(r["seed"], r["variant"]) for r in rows] == [(s, v.label) for s in (0, 1) for v in study.VARIANTS]
    steps = study.QUICK.steps
    for r in rows:
        assert (r["p"], r["n"], r["lr"]) == (2, 1, 0.01)
        assert len(r["losses"]) == steps
        assert r["diverged"] or all(math.isfinite(v) for v in (*r["losses"], r["final"], r["ratio"]))
        assert r["tokens_per_s_simulated"] > 0
        assert r["steps_to_target"] is None or 1 <= r["steps_to_target"] <= steps
    for sync in (rows[0], rows[len(study.VARIANTS)]):
        assert sync["variant"] == "sync" and sync["ratio"] == 1.0 and not sync["diverged"]
    assert rows[0]["losses"] != rows[len(study.VARIANTS)]["losses"]  # another seed, another run
    speed = {r["variant"]: r["tokens_per_s_simulated"] for r in rows[:len(study.VARIANTS)]}
    # no flush bubble: every asynchronous mode outruns synchronous 1F1B; a stash saves the recompute
    assert speed["pipedream"] > speed["naive"] > speed["naive+W"] > speed["sync"]
    table = capsys.readouterr().out
    assert "tokens/s (sim)" in table and all(v.label in table for v in study.VARIANTS)
    assert "ratio to sync; seeds 0 / 1" in table  # the per-seed summary
    assert plot.stat().st_size > 0


def test_quick_study_with_sgd(study, tmp_path, capsys):
    out = tmp_path / "rows.json"
    plot = tmp_path / "curves.png"
    argv = ["--quick", "--configs", "2x1", "--optimizer", "sgd", "--variants", "naive", "pipemare",
            "--json", str(out), "--plot", str(plot)]
    assert study.main(argv) == 0
    rows = json.loads(out.read_text())
    lrs = study.DEFAULT_LRS["sgd"]
    assert [(r["lr"], r["variant"]) for r in rows] == [(lr, v) for lr in lrs for v in ("sync", "naive", "pipemare")]
    for r in rows:
        assert r["optimizer"] == "sgd" and len(r["losses"]) == study.QUICK.steps
        assert r["diverged"] or all(math.isfinite(v) for v in (*r["losses"], r["final"], r["ratio"]))
    assert not rows[0]["diverged"] and rows[0]["ratio"] == 1.0
    assert "SGD (momentum 0.9)" in capsys.readouterr().out
    assert plot.stat().st_size > 0


def test_sgd_is_not_adam(study, tmp_path):
    """--optimizer reaches the training: the same run with Adam and SGD gives other losses."""
    losses = {}
    for name in ("adam", "sgd"):
        out = tmp_path / f"{name}.json"
        assert study.main(["--quick", "--configs", "2x1", "--optimizer", name, "--lrs", "0.01",
                           "--variants", "naive", "--plot", "none", "--json", str(out)]) == 0
        losses[name] = [r["losses"] for r in json.loads(out.read_text())]
    assert losses["adam"][0][0] == losses["sgd"][0][0]  # same weights and first batch
    assert losses["adam"] != losses["sgd"]


def test_bad_configuration_is_an_error(study):
    with pytest.raises(SystemExit):
        study.main(["--quick", "--configs", "1x1"])
    with pytest.raises(SystemExit):
        study.main(["--quick", "--lrs", "nan"])
    with pytest.raises(SystemExit):
        study.main(["--quick", "--seeds", "-1"])
    with pytest.raises(SystemExit):
        study.main(["--quick", "--optimizer", "rmsprop"])
