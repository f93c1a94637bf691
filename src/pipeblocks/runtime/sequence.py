"""Sequence chunks (Seq1F1B, Sun et al. 2024): what a stage is told, and the K/V cache.

When a schedule cuts every microbatch into k sequence chunks, the runner calls a stage
once per (microbatch, chunk) as `module(x, chunk=SequenceChunk(...))`. The chunk says
which tokens `x` holds (`offset`, `length`, out of `total`) and gives each attention
layer its K/V over all earlier chunks of the same microbatch:

    k_all, v_all, mask = chunk.kv("blocks.3.attn").extend(k, v)
    y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)

One K/V buffer per (stage, microbatch, layer). Chunk 0 allocates a buffer for the whole
sequence; every chunk writes its K and V into its slots, and attention runs over a view
of the filled part. The attention of every chunk saves a view of that one buffer, so the
microbatch's K/V is held once (allocated by chunk 0, freed with chunk 0's graph, the last
of the microbatch), not once per chunk with each earlier chunk's prefix copied in front.

Reversed order, and a mask of one row. The buffer stores position t at index total-1-t,
so a chunk of positions [offset, end) attends over the contiguous view [total-end, total).
With keys reversed, query i (position offset+i) may see key j (position end-1-j) exactly
when i + j >= length-1: the bottom-right causal mask depends on i + j alone, so it is one
row of length+end-1 entries viewed with strides (1, 1). Attention saves its mask for the
backward; this one costs a row, not length x end. (Attention sums over keys in any order;
the reversal changes only the rounding of that sum.)

Gradient hand-back. A later chunk attends over the K/V of earlier ones, so an earlier
chunk's K/V gradient is complete only after every later chunk has run its backward (the
schedules run backward LIFO over chunks). Each chunk but the last has a pair of gradient
leaves (zero-storage tensors of its K/V shape that require grad); a later chunk's view of
the buffer (`_Window`) takes the earlier chunks' leaves as inputs and hands them their
slices of the K/V gradient. The runtime names those leaves as extra inputs of the unit, so
its B (or fused BW) accumulates the gradient into `leaf.grad`. On the earlier chunk's own
path, an identity autograd function (`_AttachGrad`) adds `leaf.grad` to the gradient
flowing into its K and V when that chunk's backward runs, then drops it. Buffers are keyed
by (stage, microbatch, layer), so two stages on one rank (V placement) keep apart; the
cache of a (stage, microbatch) is released when its chunk 0 runs its backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["SequenceChunk", "KVCache", "chunk_bounds", "reversed_causal_mask"]


def chunk_bounds(lengths: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    """[(offset, length)] of consecutive chunks."""
    out, offset = [], 0
    for n in lengths:
        out.append((offset, n))
        offset += n
    return out


def reversed_causal_mask(s_q: int, s_k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive mask [s_q, s_k] for queries at the last s_q of s_k positions against keys in
    reversed position order (key j at position s_k-1-j): 0 where i + j >= s_q-1, else -inf.

    A strided view (strides (1, 1)) of one row of s_q + s_k - 1 entries."""
    row = torch.zeros(s_q + s_k - 1, dtype=dtype, device=device)
    row[: s_q - 1] = float("-inf")
    return row.as_strided((s_q, s_k), (1, 1))


class _Leaves:
    """Gradient leaves of one chunk's K and V in one layer (a plain holder, so that autograd
    does not treat them as inputs of `_AttachGrad`)."""

    __slots__ = ("k", "v")

    def __init__(self, like: Tensor) -> None:
        # Only their gradient is used: expanded from one zero, they own no memory of their shape.
        zero = torch.zeros((), dtype=like.dtype, device=like.device)
        self.k = zero.expand(like.shape).requires_grad_(True)
        self.v = zero.expand(like.shape).requires_grad_(True)


class _Buffer:
    """One layer's K/V of one (stage, microbatch), whole sequence, positions reversed."""

    __slots__ = ("k", "leaves", "spans", "v")

    def __init__(self, like: Tensor, total: int) -> None:
        b, a, _, d = like.shape
        self.k = like.new_empty(b, a, total, d)
        self.v = like.new_empty(b, a, total, d)
        self.spans: list[tuple[int, int]] = []  # (offset, length) of the chunks written so far
        self.leaves: list[_Leaves] = []  # of every chunk but the last


class _AttachGrad(torch.autograd.Function):
    """Identity on (k, v); its backward adds the gradient later chunks left on the leaves."""

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, leaves: _Leaves) -> tuple[Tensor, Tensor]:
        ctx.leaves = leaves
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, grad_k: Tensor, grad_v: Tensor):
        leaves = ctx.leaves
        if leaves.k.grad is not None:
            grad_k = grad_k + leaves.k.grad
        if leaves.v.grad is not None:
            grad_v = grad_v + leaves.v.grad
        leaves.k.grad = leaves.v.grad = None  # consumed: this chunk's backward is the last user
        return grad_k, grad_v, None


class _Window(torch.autograd.Function):
    """Writes this chunk's K/V into the buffer and returns the buffer's view over positions
    0..end-1 (reversed). Backward: this chunk's slice goes to k and v, each earlier chunk's
    slice to its gradient leaves. Saves no tensor; it may run twice (the B/W split re-runs
    a join node), so it has no side effects in backward."""

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, buffer: _Buffer, *earlier: Tensor) -> tuple[Tensor, Tensor]:
        offset, n = buffer.spans[-1]
        total, end = buffer.k.size(-2), offset + n
        # Written through `.data`: an in-place write on the buffer itself would bump the version
        # counter that earlier chunks' saved views share, and fail their backward, though their
        # slots are untouched.
        buffer.k.data[..., total - end:total - offset, :] = k.flip(-2)
        buffer.v.data[..., total - end:total - offset, :] = v.flip(-2)
        ctx.spans = buffer.spans[: len(earlier) // 2]
        ctx.offset, ctx.end = offset, end
        return buffer.k[..., total - end:, :], buffer.v[..., total - end:, :]

    @staticmethod
    def backward(ctx, grad_k: Tensor, grad_v: Tensor):
        end, n = ctx.end, ctx.end - ctx.offset  # this chunk's keys are the first n of the view
        grads: list[Tensor | None] = [grad_k[..., :n, :].flip(-2), grad_v[..., :n, :].flip(-2), None]
        for start, length in ctx.spans:
            lo, hi = end - start - length, end - start
            grads += [grad_k[..., lo:hi, :].flip(-2), grad_v[..., lo:hi, :].flip(-2)]
        return tuple(grads)


class KVCache:
    """Per runner: for every (stage, microbatch) in flight, each layer's K/V buffer.

    During one forward call it collects the gradient leaves of the earlier chunks that the
    call attended over; the runtime takes them (`take_used`) as the unit's extra backward
    inputs.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int], dict[str, _Buffer]] = {}
        self._used: list[Tensor] = []

    def extend(self, chunk: SequenceChunk, layer: str, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        layers = self._entries.setdefault((chunk.stage, chunk.microbatch), {})
        buffer = layers.get(layer)
        done = 0 if buffer is None else len(buffer.spans)
        if done != chunk.index:
            raise RuntimeError(
                f"stage {chunk.stage}, microbatch {chunk.microbatch}: layer {layer!r} got chunk {chunk.index} after "
                f"{done} earlier chunks; chunks of a microbatch must go forward in order 0..{chunk.count - 1}, "
                "and each attention layer must call extend once per chunk"
            )
        if buffer is None:
            buffer = layers[layer] = _Buffer(k, chunk.total)
        earlier = list(buffer.leaves)
        if chunk.index < chunk.count - 1:  # a later chunk will attend over this one's K/V
            leaves = _Leaves(k)
            k, v = _AttachGrad.apply(k, v, leaves)
            buffer.leaves.append(leaves)
        buffer.spans.append((chunk.offset, chunk.length))
        flat = [t for lv in earlier for t in (lv.k, lv.v)]
        self._used += flat
        k_all, v_all = _Window.apply(k, v, buffer, *flat)
        mask = reversed_causal_mask(chunk.length, chunk.offset + chunk.length, k.dtype, k.device)
        return k_all, v_all, mask

    def take_used(self) -> tuple[Tensor, ...]:
        used, self._used = tuple(self._used), []
        return used

    def release(self, stage: int, microbatch: int) -> None:
        """Drop the cache of (stage, microbatch): its chunk 0 has run its backward."""
        self._entries.pop((stage, microbatch), None)

    def __len__(self) -> int:
        return len(self._entries)

    def in_flight(self) -> list[tuple[int, int]]:
        return sorted(self._entries)


@dataclass(frozen=True)
class SequenceChunk:
    """Which part of which microbatch a stage call runs (the `chunk=` argument).

    stage: the global stage.  microbatch: 0..m-1.  index: the chunk, 0..count-1.
    offset, length: the tokens [offset, offset + length) of the microbatch's sequence.
    total: tokens of the whole sequence.  cache: the runner's K/V cache.
    """

    stage: int
    microbatch: int
    index: int
    count: int
    offset: int
    length: int
    total: int
    cache: KVCache | None = field(default=None, repr=False, compare=False)

    def kv(self, layer: str) -> _LayerKV:
        """The K/V extender of one attention layer (`layer`: a name unique within the stage)."""
        if self.cache is None:
            raise RuntimeError("this SequenceChunk has no K/V cache: the runner attaches one before calling a stage")
        return _LayerKV(self, layer)


@dataclass(frozen=True)
class _LayerKV:
    chunk: SequenceChunk
    layer: str

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """This chunk's K/V [b, a, length, d] -> (K, V) over positions 0..offset+length-1, in
        reversed order, and the additive causal mask [length, offset+length] for that order."""
        return self.chunk.cache.extend(self.chunk, self.layer, k, v)
