"""A warning for `train --tp T` on CUDA under torchrun (no torch here).

What `--tp` refuses is in `composition.REFUSALS` (with --async, --seq-chunks, --clip-grad,
a sharding FSDP2 does not run, a model without a plan) and in `models.tp_plan.check_tp`
(sizes T must divide). What runs under tp > 1 is documented in docs/tensor-parallel.md.
"""
from __future__ import annotations

import os
import sys

__all__ = ["warn_tp_across_nodes"]


def warn_tp_across_nodes(tp: int, device: str) -> None:
    """On CUDA under torchrun, say so when a tp group would span machines (its per-layer
    collectives would cross the slower link between them)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if tp == 1 or device != "cuda" or local is None:
        return
    if int(local) % tp:
        print(f"warning: --tp {tp} does not divide the {local} processes per node (LOCAL_WORLD_SIZE): tensor-parallel "
              "groups would span nodes, and their collectives (several per layer) cross the network; use a --tp "
              f"that divides {local}", file=sys.stderr, flush=True)
