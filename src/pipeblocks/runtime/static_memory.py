"""The static-memory prediction the runtime is held to; it needs no torch, so it lives in
`pipeblocks.core.static_memory` (where the simulator's memory estimate uses it too)."""
from __future__ import annotations

from ..core.static_memory import ChunkBytes, chunk_bytes, predict_static_peak, zero1_partition

__all__ = ["ChunkBytes", "chunk_bytes", "predict_static_peak", "zero1_partition"]
