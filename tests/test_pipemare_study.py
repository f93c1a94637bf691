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
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_quick_study_table(study, tmp_path, capsys):
    out = tmp_path / "rows.json"
    plot = tmp_path / "curves.png"
    assert study.main(["--quick", "--configs", "3x1", "--lrs", "0.01", "--json", str(out), "--plot", str(plot)]) == 0
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == [v.label for v in study.VARIANTS]
    steps = study.QUICK.steps
    for r in rows:
        assert (r["p"], r["n"], r["lr"]) == (3, 1, 0.01)
        assert len(r["losses"]) == steps
        assert r["diverged"] or all(math.isfinite(v) for v in (*r["losses"], r["final"], r["ratio"]))
        assert r["tokens_per_s_simulated"] > 0
        assert r["steps_to_target"] is None or 1 <= r["steps_to_target"] <= steps
    sync = rows[0]
    assert sync["ratio"] == 1.0 and not sync["diverged"]
    speed = {r["variant"]: r["tokens_per_s_simulated"] for r in rows}
    # no flush bubble: every asynchronous mode outruns synchronous 1F1B; a stash saves the recompute
    assert speed["pipedream"] > speed["naive"] > speed["naive+W"] > speed["sync"]
    table = capsys.readouterr().out
    assert "tokens/s (sim)" in table and all(v.label in table for v in study.VARIANTS)
    assert plot.stat().st_size > 0


def test_bad_configuration_is_an_error(study):
    with pytest.raises(SystemExit):
        study.main(["--quick", "--configs", "1x1"])
    with pytest.raises(SystemExit):
        study.main(["--quick", "--lrs", "nan"])
