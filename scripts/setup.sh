#!/usr/bin/env bash
# Install pipeblocks and everything it needs. torch is pinned to the CPU build first, so
# that resolving the package's own dependencies pulls no CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
