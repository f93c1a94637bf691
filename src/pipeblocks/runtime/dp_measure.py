"""What a data-parallel run measures of itself: its dp link, and the static bytes it holds.

    bandwidth, latency = measure_link(mesh.dp_group)     # a collective: every replica calls it
    held_bytes([*model.parameters(), *(p.grad for p in model.parameters())])
    held_bytes(chunk_static_tensors(dp.chunks.values()))  # a DataParallel's chunks (its static_tensors)

`chunk_static_tensors` lists what a DataParallel's chunks hold: their parameters and
gradients, FSDP2's accumulated gradients, and the buffers of gathers issued and not yet
waited.

Static bytes (`held_bytes`): parameters, gradients and optimizer state this process holds,
counted once per storage (sharded and gathered parameters both count as parameters). The
peak (`DataParallel.sample_static`) is sampled where it can occur: before each op that
frees (REDUCE_GRAD, RESHARD), before each reduction launched inside a pass, and after the
optimizer step. What each policy holds at that peak, for a chunk of P parameter bytes on d
replicas (fp32 AdamW: gradient P, state 2P):

    replicate  P + P + 2P                                  (after the optimizer step)
    zero1      P + P + 2P_r     P_r: this replica's partition (after the optimizer step)
    zero2/3    P/d + P + P + 2P/d  sharded and gathered parameters, unreduced full
               gradients, sharded state (before REDUCE_GRAD)

The textbook ZeRO-2/ZeRO-3 figures (4P + 12P/d, 16P/d) hold between steps only: one
reduction per step means full-size gradients accumulate until REDUCE_GRAD, and FSDP2 keeps
parameters gathered from the first pass to the last (a gather per microbatch would cost d
times the traffic). Between steps FSDP2's zero2 holds parameters sharded, below ZeRO-2.
"""
from __future__ import annotations

import time
from typing import Iterable

import torch
import torch.distributed as dist

from ..core.ir.sharding import FSDP_POLICIES
from .dp_chunks import ChunkState
from .dp_units import accumulated_grads, gathers_in_flight

__all__ = ["chunk_static_tensors", "held_bytes", "measure_link"]


def measure_link(group: dist.ProcessGroup, *, large_bytes: int = 1 << 21, repeats: int = 5) -> tuple[float, float]:
    """(bandwidth in bytes/s, latency per ring step in s) of the dp group, fitted to the ring
    all-reduce model 2(d-1)/d * n/bw + 2(d-1)*a from the median time of a one-element and a
    `large_bytes` all-reduce (a collective: every replica calls it)."""
    d = dist.get_world_size(group)
    if d == 1:
        return float("inf"), 0.0

    def timed(numel: int) -> float:
        tensor = torch.zeros(numel, dtype=torch.float64)
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    small, large = timed(1), timed(max(2, large_bytes // 8))
    latency = small / (2 * (d - 1))
    moved = 2 * (d - 1) / d * (large_bytes - 8)
    bandwidth = moved / max(large - small, 1e-9)
    return bandwidth, latency


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        pointer, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or pointer in seen:
            continue
        seen.add(pointer)
        total += size
    return total


def chunk_static_tensors(chunks: Iterable[ChunkState]) -> list[torch.Tensor | None]:
    """The parameters and gradients `chunks` hold (None for a missing gradient), with
    FSDP2's accumulated gradients and the output buffers of its gathers in flight."""
    tensors: list[torch.Tensor | None] = []
    for chunk in chunks:
        for param in (*chunk.own_params, *chunk.module.parameters()):
            tensors.append(param)
            tensors.append(param.grad)
        if chunk.policy in FSDP_POLICIES:
            tensors.extend(accumulated_grads(chunk.module))
            # a gather issued and not yet waited holds its buffer already
            if chunk.unshard_handle is not None:
                tensors.extend(gathers_in_flight(chunk.module))
            tensors.extend(t for unit in chunk.units or () if unit.handle is not None
                           for t in gathers_in_flight(unit.fsdp))
    return tensors
