"""The static bytes (parameters, gradients, optimizer state) a rank will hold, predicted
from the parameter shapes and the Program, the way the runtime (`runtime.data_parallel`) holds them.

    peak = predict_static_peak(program, rank, shapes, policies, dp=2, dp_rank=0)

No torch here: the prediction needs only shapes, the element size and the op order. It
follows what torch does (torch 2.13), so that the measured peak can be held to it:

* FSDP2 (zero2, zero3) shards each parameter along dim 0 into d chunks of ceil(n0/d) rows,
  padded: every replica stores ceil(n0/d) rows of each parameter, and so does the
  reduce-scattered gradient; the gathered parameter is the padded d*ceil(n0/d) rows. The
  optimizer state follows the unpadded local shard (`torch.chunk` rows: the last replicas
  may hold fewer, or none).
* ZeroRedundancyOptimizer (zero1) gives whole tensors to replicas, largest first, each to
  the replica with the fewest elements so far.
* AdamW keeps two moments per parameter element (its step counters, a few bytes per
  tensor, are left out).

Over one step the bytes change at known ops: a sharded chunk is gathered at its first pass
(zero2) or its UNSHARD (zero3) and freed at REDUCE_GRAD (zero2) or RESHARD (zero3); its
full gradient appears at its first weight-gradient pass (W or BW) and, for FSDP2 chunks,
is replaced by its shard at REDUCE_GRAD. The peak is the largest total before an op that
frees and after the optimizer step, where the runtime samples it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .actions import Action, Kind
from .program import DPOp, Program
from .sharding import ShardingPolicy

__all__ = ["ChunkBytes", "chunk_bytes", "predict_static_peak", "zero1_partition"]

_FSDP = (ShardingPolicy.ZERO2, ShardingPolicy.ZERO3)
ADAM_MOMENTS = 2


def _rows(n0: int, d: int, rank: int) -> int:
    """Rows of dim 0 that `torch.chunk(t, d)` gives chunk `rank` (chunks of ceil(n0/d))."""
    size = math.ceil(n0 / d) if n0 else 0
    return max(0, min(size, n0 - size * rank)) if size else 0


def zero1_partition(numels: Sequence[int], world: int) -> list[list[int]]:
    """Indices of the tensors each replica owns under ZeroRedundancyOptimizer's rule: largest
    first, each to the replica with the fewest elements so far (ties: the lowest rank)."""
    owned: list[list[int]] = [[] for _ in range(world)]
    sizes = [0] * world
    for index in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):
        rank = sizes.index(min(sizes))
        owned[rank].append(index)
        sizes[rank] += numels[index]
    return owned


@dataclass(frozen=True)
class ChunkBytes:
    """One chunk's static bytes on one replica, in the pieces that come and go in a step."""

    params: int
    """parameters held at all times (all of them, or this replica's padded shards)"""
    gathered: int
    """parameters gathered for the step on top of `params` (0 unless zero2/zero3)"""
    grads_full: int
    """gradients while they accumulate (full size)"""
    grads_reduced: int
    """gradients after REDUCE_GRAD (full size, or the padded shard)"""
    optimizer: int
    """optimizer state (AdamW's two moments over what this replica updates)"""

    @property
    def peak(self) -> int:
        """Everything at once: what the chunk holds before its REDUCE_GRAD once the
        optimizer state exists. Every schedule's op walk (`predict_static_peak`) peaks with
        all of a rank's chunks there, since no chunk reduces before the others' first
        weight-gradient pass."""
        return self.params + self.gathered + self.grads_full + self.optimizer


def chunk_bytes(shapes: Sequence[tuple[int, ...]], element_size: int, policy: ShardingPolicy, d: int,
                dp_rank: int) -> ChunkBytes:
    """The pieces for a chunk whose trainable parameters have `shapes`."""
    policy = ShardingPolicy(policy)
    numels = [math.prod(s) for s in shapes]
    full = sum(numels) * element_size
    if policy in _FSDP:
        padded = local = 0
        for shape, n in zip(shapes, numels):
            n0 = shape[0] if shape else 1
            rest = n // n0 if n0 else 0
            padded += math.ceil(n0 / d) * rest
            local += _rows(n0, d, dp_rank) * rest
        shard = padded * element_size
        return ChunkBytes(shard, shard * d, full, shard, ADAM_MOMENTS * local * element_size)
    if policy is ShardingPolicy.ZERO1:
        owned = sum(numels[i] for i in zero1_partition(numels, d)[dp_rank]) * element_size
        return ChunkBytes(full, 0, full, full, ADAM_MOMENTS * owned)
    return ChunkBytes(full, 0, full, full, ADAM_MOMENTS * full)


def predict_static_peak(
    program: Program,
    rank: int,
    shapes: Mapping[int, Sequence[tuple[int, ...]]],
    policies: Sequence[ShardingPolicy],
    *,
    dp: int,
    dp_rank: int,
    element_size: int,
    optimizer_state: bool = True,
) -> int:
    """Peak static bytes of pipeline rank `rank`, replica `dp_rank`, over one step.

    shapes: stage -> its trainable parameters' shapes (this rank's stages).
    policies: one per global stage. optimizer_state: whether the state exists when the step
    starts (every step after the first); it exists after the optimizer step regardless.
    """
    pieces = {s: chunk_bytes(shapes[s], element_size, policies[s], dp, dp_rank) for s in shapes}
    policy = {s: ShardingPolicy(policies[s]) for s in shapes}
    gathered = dict.fromkeys(pieces, False)
    grads: dict[int, int] = dict.fromkeys(pieces, 0)

    def total(with_state: bool) -> int:
        return sum(
            c.params + (c.gathered if gathered[s] else 0) + grads[s] + (c.optimizer if with_state else 0)
            for s, c in pieces.items()
        )

    peak = 0
    for op in program.ranks[rank]:
        if type(op) is Action:
            s = op.stage
            if policy[s] is ShardingPolicy.ZERO2 and not gathered[s] and grads[s] == 0:
                gathered[s] = True  # gathered by its first pass of the step
            if op.kind is Kind.W or op.kind is Kind.BW:
                grads[s] = pieces[s].grads_full
        elif type(op) is DPOp:
            s = op.stage
            if op.kind == "UNSHARD":
                gathered[s] = True
                continue
            peak = max(peak, total(optimizer_state))  # sampled before an op that frees
            if op.kind == "RESHARD":
                gathered[s] = False
            elif op.kind == "REDUCE_GRAD":
                grads[s] = pieces[s].grads_reduced
                if policy[s] is ShardingPolicy.ZERO2:
                    gathered[s] = False
    for s in pieces:  # the optimizer steps after every reduction is done
        gathered[s] = False
        if grads[s]:
            grads[s] = pieces[s].grads_reduced
    return max(peak, total(True))
