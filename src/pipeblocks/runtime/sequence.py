"""Sequence chunks (Seq1F1B, ALGORITHMS.md §5.3): what a stage is told, and the K/V cache.

When a schedule cuts every microbatch into k sequence chunks, the runner calls a stage
once per (microbatch, chunk) as `module(x, chunk=SequenceChunk(...))`. The chunk says
which tokens `x` holds (`offset`, `length`, out of `total`) and gives each attention
layer its K/V over all earlier chunks of the same microbatch:

    k_all, v_all = chunk.kv("blocks.3.attn").extend(k, v)     # [b, a, offset + length, d]

Gradient hand-back. A later chunk attends over the K/V of earlier ones, so the earlier
chunk's K/V gradient is only complete after every later chunk has run its backward (the
schedules run backward LIFO over chunks). `extend` stores *detached leaf copies* of this
chunk's K and V in the cache and concatenates the leaves of the earlier chunks in front
of the live K/V. A later chunk's backward therefore ends in those leaves: the runtime
names them as extra inputs of the unit, so its B (or fused BW) accumulates their
gradient into `leaf.grad`. On the earlier chunk's own path, an identity autograd
function (`_AttachGrad`) adds `leaf.grad` to the gradient flowing into its K and V when
that chunk's backward runs, then drops it. Leaves are keyed by (stage, microbatch, layer),
so two stages on one rank (V placement) keep apart; the cache of a (stage, microbatch)
is released when its chunk 0 runs its backward.

Masks. Attention saves its mask for the backward; `causal_mask` gives every layer the
same additive bottom-right mask tensor for a (queries, keys) shape, so it is held once,
not once per layer. Masks are dropped when no microbatch is in flight.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["SequenceChunk", "KVCache", "chunk_bounds"]


def chunk_bounds(lengths: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    """[(offset, length)] of consecutive chunks."""
    out, offset = [], 0
    for n in lengths:
        out.append((offset, n))
        offset += n
    return out


class _Leaves:
    """Detached leaf copies of one chunk's K and V in one layer (a plain holder, so that
    autograd does not treat them as inputs of `_AttachGrad`)."""

    __slots__ = ("k", "v")

    def __init__(self, k: Tensor | None, v: Tensor | None) -> None:
        self.k = k
        self.v = v


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


class KVCache:
    """Per runner: for every (stage, microbatch) in flight, each layer's K/V leaves by chunk.

    `leaves_used` collects, during one forward call, the leaves that call attended over;
    the runtime takes them (`take_used`) as the unit's extra backward inputs.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int], dict[str, list[_Leaves]]] = {}
        self._used: list[Tensor] = []
        self._masks: dict[tuple, Tensor] = {}

    def extend(self, chunk: SequenceChunk, layer: str, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        layers = self._entries.setdefault((chunk.stage, chunk.microbatch), {})
        prefix = layers.setdefault(layer, [])
        if len(prefix) != chunk.index:
            raise RuntimeError(
                f"stage {chunk.stage}, microbatch {chunk.microbatch}: layer {layer!r} got chunk {chunk.index} after "
                f"{len(prefix)} earlier chunks; chunks of a microbatch must go forward in order 0..{chunk.count - 1}, "
                "and each attention layer must call extend once per chunk"
            )
        if chunk.index < chunk.count - 1:  # a later chunk will attend over this one's K/V
            leaves = _Leaves(k.detach().requires_grad_(True), v.detach().requires_grad_(True))
            k, v = _AttachGrad.apply(k, v, leaves)
            prefix.append(leaves)
        else:
            prefix.append(_Leaves(None, None))  # the last chunk's K/V are never attended by another chunk
        if chunk.index == 0:
            return k, v
        earlier = prefix[: chunk.index]
        for leaves in earlier:
            self._used += (leaves.k, leaves.v)
        return (torch.cat([lv.k for lv in earlier] + [k], dim=-2),
                torch.cat([lv.v for lv in earlier] + [v], dim=-2))

    def causal_mask(self, s_q: int, s_k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Additive mask [s_q, s_k]: query i, at position s_k - s_q + i, sees keys 0..s_k - s_q + i."""
        key = (s_q, s_k, dtype, torch.device(device))
        mask = self._masks.get(key)
        if mask is None:
            allowed = torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril(diagonal=s_k - s_q)
            mask = torch.zeros(s_q, s_k, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))
            self._masks[key] = mask
        return mask

    def take_used(self) -> tuple[Tensor, ...]:
        used, self._used = tuple(self._used), []
        return used

    def release(self, stage: int, microbatch: int) -> None:
        """Drop the cache of (stage, microbatch): its chunk 0 has run its backward."""
        self._entries.pop((stage, microbatch), None)
        if not self._entries:
            self._masks.clear()

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

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """This chunk's K/V [b, a, length, d] -> K/V over positions 0..offset+length-1."""
        return self.chunk.cache.extend(self.chunk, self.layer, k, v)

    def causal_mask(self, s_q: int, s_k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.chunk.cache.causal_mask(s_q, s_k, dtype, device)
