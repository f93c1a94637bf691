"""The static bytes (parameters, gradients, optimizer state) a rank will hold, predicted
from the parameter shapes and the Program, the way the runtime (`runtime.data_parallel`) holds them.

    peak = predict_static_peak(program, rank, shapes, policies, dp=2, dp_rank=0,
                               precision=precision_policy("bf16-mixed"))

No torch here: the prediction needs only shapes, the precision (`core.cost.precision`: the bytes
per element of the masters, the compute copy, the gradients and AdamW's state, as
`core.cost.dp_model.Precision` lists them) and the op order. It follows what torch does (torch
2.13), so that the measured peak can be held to it:

* FSDP2 (zero2, zero3) shards each parameter along dim 0 into d chunks of ceil(n0/d) rows,
  padded: every replica stores ceil(n0/d) rows of each parameter, and so does the
  reduce-scattered gradient; the gathered parameter is the padded d*ceil(n0/d) rows. The
  optimizer state follows the unpadded local shard (`torch.chunk` rows: the last replicas
  may hold fewer, or none).
* ZeroRedundancyOptimizer (zero1) gives whole tensors to replicas, largest first, each to
  the replica with the fewest elements so far.
* AdamW keeps two moments per parameter element in the master dtype (its step counters, a
  few bytes per tensor, are left out).
* Mixed precision (bf16-mixed): a chunk FSDP2 shards gathers its parameters in the compute
  dtype (`MixedPrecisionPolicy(param_dtype=bfloat16)`) beside its float32 shard, and
  accumulates the full gradient in float32 until REDUCE_GRAD reduce-scatters it; every
  other chunk (replicate, zero1) keeps float32 masters and holds a compute copy
  (`runtime.precision.ComputeCopies`) from its first pass of the step to the step's end.

Over one step the bytes change at known ops: a sharded chunk is gathered at its first pass
(zero2) or its UNSHARD (zero3) and freed at REDUCE_GRAD (zero2) or RESHARD (zero3; a
zero3-regather chunk at each of its UNSHARDs and RESHARDs, the accumulated full gradient
kept across them, as FSDP2 keeps it while gradient sync is off); an
unsharded chunk's compute copy appears at its first pass and goes before the optimizer
step; its full gradient appears at its first weight-gradient pass (W or BW) and, for FSDP2
chunks, is replaced by its shard at REDUCE_GRAD. The peak is the largest total before an op
that frees, at the end of the op walk (before the optimizer step: the copies and the
accumulated gradients, on one replica with no DP op at all) and after the optimizer step,
where the runtime samples it (with the gathers that open the next step already issued:
`gather_ahead`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..ir.actions import Action, Kind
from .dp_model import Precision, w_gradients_wait
from .precision import PrecisionPolicy, precision_policy
from ..ir.ops import DPOp, expanded
from ..ir.program import Program
from ..ir.sharding import ShardingPolicy

__all__ = ["ChunkBytes", "chunk_bytes", "predict_static_peak", "zero1_partition"]

# the dtype of a same-dtype policy (master = compute = reduce) by its element size
_SAME_DTYPE = {8: "float64", 4: "float32", 2: "bfloat16"}


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


def _precision(element_size: int | None, precision: PrecisionPolicy | None) -> Precision:
    """The bytes of `precision`, or of the same-dtype policy of `element_size`."""
    if precision is not None:
        if element_size is not None:
            raise TypeError("give precision= or element_size=, not both")
        if not isinstance(precision, PrecisionPolicy):
            raise TypeError(f"precision must be a PrecisionPolicy (core.cost.precision), got {type(precision).__name__}")
        return Precision.of(precision)
    if element_size is None:
        raise TypeError("give precision= (a core.cost.precision.PrecisionPolicy) or element_size=")
    dtype = _SAME_DTYPE.get(element_size)
    if dtype is None:
        raise ValueError(f"element_size {element_size!r}: give 2, 4 or 8 bytes, or precision= for another policy")
    name = {"float64": "fp64", "float32": "fp32"}.get(dtype)
    policy = precision_policy(name) if name else PrecisionPolicy(dtype, dtype, dtype, dtype)
    return Precision.of(policy)


@dataclass(frozen=True)
class ChunkBytes:
    """One chunk's static bytes on one replica, in the pieces that come and go in a step."""

    params: int
    """parameters held at all times (all of them, or this replica's padded shards)"""
    gathered: int
    """parameters gathered for the step on top of `params` (0 unless zero2/zero3)"""
    copy: int
    """the compute copy of a chunk FSDP2 does not shard, held from its first pass to the
    step's end (0 unless mixed precision)"""
    grads_full: int
    """gradients while they accumulate (full size)"""
    grads_reduced: int
    """gradients after REDUCE_GRAD (full size, or the padded shard)"""
    optimizer: int
    """optimizer state (AdamW's two moments over what this replica updates)"""

    pending: int = 0
    """under mixed precision, an FSDP2 chunk's compute-dtype gradients of a W run apart from
    its B, held on the gathered parameters until REDUCE_GRAD (0 otherwise)"""

    @property
    def peak(self) -> int:
        """Everything at once: what the chunk holds before its REDUCE_GRAD once the
        optimizer state exists, for a fused backward. Every schedule's op walk
        (`predict_static_peak`) peaks with all of a rank's chunks there, since no chunk
        reduces before the others' first weight-gradient pass, unless a zero3-regather
        chunk is freed there (then the walk's peak is lower)."""
        return self.params + self.gathered + self.copy + self.grads_full + self.optimizer

    def step_peak(self, split_backward: bool) -> int:
        """`peak`, with a split backward's held gradients (`pending`) when W runs apart from B."""
        return self.peak + (self.pending if split_backward else 0)


def chunk_bytes(
    shapes: Sequence[tuple[int, ...]],
    element_size: int | None = None,
    policy: ShardingPolicy = ShardingPolicy.REPLICATE,
    d: int = 1,
    dp_rank: int = 0,
    *,
    precision: PrecisionPolicy | None = None,
) -> ChunkBytes:
    """The pieces for a chunk whose trainable parameters have `shapes`, under `precision`
    (or `element_size`: a policy whose master, compute and reduce dtypes all have that size)."""
    return _chunk(shapes, _precision(element_size, precision), policy, d, dp_rank)


def _chunk(shapes: Sequence[tuple[int, ...]], b: Precision, policy: ShardingPolicy, d: int, dp_rank: int) -> ChunkBytes:
    policy = ShardingPolicy(policy)
    numels = [math.prod(s) for s in shapes]
    total = sum(numels)
    if policy.fsdp:
        padded = local = 0
        for shape, n in zip(shapes, numels):
            n0 = shape[0] if shape else 1
            rest = n // n0 if n0 else 0
            padded += math.ceil(n0 / d) * rest
            local += _rows(n0, d, dp_rank) * rest
        return ChunkBytes(
            params=int(padded * b.master), gathered=int(padded * d * b.gathered), copy=0,
            grads_full=int(total * b.grad), grads_reduced=int(padded * b.grad), optimizer=int(local * b.optim),
            # FSDP2 folds a microbatch's gradient into its float32 sum when the backward reaches the
            # chunk's input; a W run apart from B comes after that fold
            pending=int(padded * d * b.gathered) if b.gathered != b.grad else 0,
        )
    owned = total
    if policy is ShardingPolicy.ZERO1:
        owned = sum(numels[i] for i in zero1_partition(numels, d)[dp_rank])
    return ChunkBytes(
        params=int(total * b.master), gathered=0, copy=int(total * b.copy), grads_full=int(total * b.grad),
        grads_reduced=int(total * b.grad), optimizer=int(owned * b.optim),
    )


def predict_static_peak(
    program: Program,
    rank: int,
    shapes: Mapping[int, Sequence[tuple[int, ...]]],
    policies: Sequence[ShardingPolicy],
    *,
    dp: int,
    dp_rank: int,
    element_size: int | None = None,
    precision: PrecisionPolicy | None = None,
    optimizer_state: bool = True,
    gather_ahead: bool = True,
) -> int:
    """Peak static bytes of pipeline rank `rank`, replica `dp_rank`, over one step.

    shapes: stage -> its trainable parameters' shapes (this rank's stages).
    policies: one per global stage. precision: the training precision (or element_size, a
    same-dtype one: 4 is fp32). optimizer_state: whether the state exists when the step
    starts (every step after the first); it exists after the optimizer step regardless.
    gather_ahead: the runtime issues the gathers that open the rank's Program (its leading
    UNSHARDs) right after the optimizer step (`runtime.data_parallel`), so they are held
    there, beside the stepped state.
    """
    b = _precision(element_size, precision)
    pieces = {s: _chunk(shapes[s], b, policies[s], dp, dp_rank) for s in shapes}
    policy = {s: ShardingPolicy(policies[s]) for s in shapes}
    gathered = dict.fromkeys(pieces, False)
    copied = dict.fromkeys(pieces, False)
    grads: dict[int, int] = dict.fromkeys(pieces, 0)
    # FSDP2 folds a microbatch's gradient into its float32 sum when the chunk's backward reaches
    # the chunk's input; a split backward's W comes after that, so under mixed precision its
    # compute-dtype gradients stay on the gathered parameters until the next fold or REDUCE_GRAD
    # (not on stage 0: `dp_model.w_gradients_wait`)
    pending = dict.fromkeys(pieces, False)

    def total(with_state: bool) -> int:
        return sum(
            c.params + (c.gathered if gathered[s] else 0) + (c.copy if copied[s] else 0) + grads[s]
            + (c.pending if pending[s] else 0) + (c.optimizer if with_state else 0)
            for s, c in pieces.items()
        )

    peak = 0
    for op in expanded(program.ranks[rank]):
        if type(op) is Action:
            s = op.stage
            copied[s] = True  # an unsharded chunk's compute copy (if any) lives from its first pass
            if policy[s] is ShardingPolicy.ZERO2 and not gathered[s] and grads[s] == 0:
                gathered[s] = True  # gathered by its first pass of the step
            if op.kind is Kind.W or op.kind is Kind.BW:
                grads[s] = pieces[s].grads_full
            if op.kind is Kind.W and w_gradients_wait(s):
                pending[s] = True
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
                pending[s] = False
                if policy[s] is ShardingPolicy.ZERO2:
                    gathered[s] = False
    # the end of the walk: copies and accumulated gradients held, the optimizer not yet stepped
    peak = max(peak, total(optimizer_state))
    leading = set()
    for op in program.ranks[rank]:
        if type(op) is not DPOp or op.kind != "UNSHARD":
            break
        leading.add(op.stage)
    for s in pieces:  # the optimizer steps after every reduction is done, the copies dropped
        gathered[s] = gather_ahead and s in leading and policy[s].fsdp
        copied[s] = False
        pending[s] = False
        if grads[s]:
            grads[s] = pieces[s].grads_reduced
    return max(peak, total(True))
