#!/usr/bin/env bash
# Install, then run the main job on the embedded default: compare every schedule at
# p=4, m=8 and write the memory-against-bubble picture and a timeline to out/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p out
pipeblocks compare -p 4 -m 8 --plot out/compare.png
pipeblocks plot 1f1b -p 4 -m 8 -o out/1f1b.png
