"""Test tiers, so a change can be checked in seconds and the whole suite still runs in CI.

    pytest -m fast      pure Python: no torch run, no process started (under a minute)
    pytest -m sweep     pure Python bulk checks: every schedule over a wide range of p and m
    pytest -m torch     runs torch in this process (models, data), starts no process
    pytest -m spawn     starts processes: torch.distributed ranks, `pipeblocks train`, torchrun
    pytest              everything (what CI runs)

A module states a slower tier with a module-level `pytestmark = pytest.mark.spawn` (or
`torch`), a single test with the decorator; every test without one is `fast`. A fast or
sweep test that starts a process fails, so a test cannot slip into them by mistake.
"""
from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest

SLOW_TIERS = ("sweep", "torch", "spawn")
PROCESS_FREE = ("fast", "sweep")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in SLOW_TIERS):
            item.add_marker(pytest.mark.fast)


class FastTestStartedAProcess(RuntimeError):
    """A test in the fast tier tried to start a process."""


def _refuse(*_args, **_kwargs):
    raise FastTestStartedAProcess(
        "a fast or sweep test started a process: mark it (or its module, with pytestmark) pytest.mark.spawn"
    )


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if any(request.node.get_closest_marker(tier) is not None for tier in PROCESS_FREE):
        monkeypatch.setattr(subprocess.Popen, "__init__", _refuse)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)
