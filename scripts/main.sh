#!/usr/bin/env bash
# Install, then run the main job on the embedded default: train the built-in Llama-style
# model (grouped-query attention, rotary positions, SwiGLU) in bf16-mixed precision on the
# text that ships with Python, with the memory-efficient V-Half schedule over 2 local
# processes (one per core of the 2-core reference machine: ranks that share cores run
# slower than the simulator, which gives each its own), and report loss, held-out loss,
# predicted against measured activation memory per rank, and measured against simulated
# iteration time; then compare every schedule at p=4, m=8.
# Everything lands in out/. pipeblocks runs from the checkout's own .venv (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p out
.venv/bin/pipeblocks train --model-family llama --kv-heads 2 --precision bf16-mixed --schedule v-half -p 2 -m 8 \
    --steps 30 --eval-every 10 --report out/train.json
.venv/bin/pipeblocks compare -p 4 -m 8 --plot out/compare.png
