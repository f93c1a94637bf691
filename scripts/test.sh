#!/usr/bin/env bash
# Install into .venv (scripts/setup.sh), then lint and run the whole test suite.
# Arguments go to pytest, e.g. `bash scripts/test.sh -m fast` for the quick tier.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"  # no arguments: every test under tests/ (pyproject testpaths)
