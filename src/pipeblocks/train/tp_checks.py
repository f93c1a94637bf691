"""What `train --tp T` refuses before launch, one line each (no torch here).

    >>> check_tensor_parallel(2, model=LlamaConfig(heads=4, kv_heads=1), seq_chunks=1, dp=1, ...)
    ValueError: --tp 2 does not divide the model's 1 KV heads (kv_heads): ...

`train.run.prepare` calls it once; tp = 1 checks nothing, so a run without --tp is
today's. What runs under tp > 1 is documented in docs/tensor-parallel.md.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Sequence

from ..core.sharding import FSDP_POLICIES
from ..models.tp_plan import check_tp

__all__ = ["check_tensor_parallel", "warn_tp_across_nodes"]

FSDP_NAMES = tuple(sorted(str(p) for p in FSDP_POLICIES))


def check_tensor_parallel(
    tp: int, *, model: Any, seq_chunks: int, dp: int, sharding: Sequence[Any], async_mode: Any,
    clip_grad: float | None,
) -> None:
    """Raise ValueError (the numbers and the fix) for a --tp the run cannot take."""
    check_tp(model, tp)
    if tp == 1:
        return
    if async_mode is not None:
        raise ValueError(f"--tp {tp} with --async is not supported: asynchronous training runs without tensor "
                         "parallelism; drop --tp (or --async)")
    if seq_chunks > 1:
        raise ValueError(
            f"--tp {tp} with --seq-chunks {seq_chunks} is not supported: under tensor parallelism a stage's tokens are "
            "already split over the tp ranks (sequence parallelism); drop --seq-chunks (or --tp)"
        )
    if clip_grad is not None:
        raise ValueError(f"--clip-grad is not supported with --tp {tp} yet (the global norm over tensor-parallel "
                         "shards): drop --clip-grad, or use --tp 1")
    policies = {str(p) for p in sharding}
    if (dp > 1 or policies != {"replicate"}) and not policies <= set(FSDP_NAMES):
        raise ValueError(
            f"--tp {tp} with --dp {dp} and sharding {','.join(sorted(policies))}: data parallelism over tensor-parallel "
            "stages runs through FSDP2; use --sharding zero2 or zero3 (or --dp 1 with replicate)"
        )


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
