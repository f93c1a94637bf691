"""Puts the tests' folder on sys.path: a few benchmarks share a rank worker with the tests
(`tests/_emulated_mesh.py`: DP communication on an emulated mesh against the simulator)."""
from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
