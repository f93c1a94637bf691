"""The test tiers (tests/conftest.py): registered, assigned, and enforced."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import FastTestStartedAProcess

ROOT = Path(__file__).resolve().parents[1]


def test_tiers_are_registered_and_unknown_markers_are_errors():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    names = {line.split(":")[0] for line in options["markers"]}
    assert {"fast", "sweep", "torch", "spawn"} <= names
    assert "--strict-markers" in options["addopts"]


def test_an_unmarked_test_is_fast(request):
    assert request.node.get_closest_marker("fast") is not None


@pytest.mark.spawn
def test_a_marked_test_is_not_fast(request):
    assert request.node.get_closest_marker("fast") is None


def test_a_fast_test_cannot_start_a_process():
    with pytest.raises(FastTestStartedAProcess, match="mark it"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    import multiprocessing

    with pytest.raises(FastTestStartedAProcess):
        multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.mark.parametrize("module", sorted(p.name for p in (ROOT / "tests").glob("test_*.py")))
def test_modules_that_run_torch_are_not_fast(module):
    """A module that imports torch at its top runs torch in the test process."""
    text = (ROOT / "tests" / module).read_text()
    top = text.split("\ndef ", 1)[0]
    if "import torch" in top or 'importorskip("torch")' in top or "from _runtime_cases" in top:
        assert "pytest.mark.torch" in top or "pytest.mark.spawn" in top, module
    if "from pipeblocks.runtime import spawn" in top or "from test_train import" in top:
        assert "pytest.mark.spawn" in top, module
