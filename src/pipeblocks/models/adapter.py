"""How a stage runs its parts: the default convention, and the adapter that overrides it.

A stage runs, in order: on stage 0 each before-module, then `ctx = context(...)` once, then
its blocks, then on the last stage each after-module. By default a part is called with the
hidden state alone (`x = module(x)`), which fits any model whose blocks take one tensor.

A model whose blocks take side inputs (positions, rotary cos/sin, a causal mask) gives an
adapter. Everything cheap is recomputed on every stage from the hidden state and the
sequence chunk, so only the hidden state crosses from one stage to the next:

    class RotaryAdapter(BlockAdapter):
        def context(self, stage, h, chunk):
            offset = chunk.offset if chunk is not None else 0
            positions = torch.arange(offset, offset + h.size(1), device=h.device)
            return stage.part("rotary")(positions)          # a shared module: every stage has it

        def run_block(self, name, block, h, ctx):
            cos, sin = ctx
            return block(h, cos, sin)

Names are the parts' paths in the full model ("model.layers.3"), unique within a stage: an
adapter that supports sequence chunks (Seq1F1B) uses a block's name as its K/V layer,
`chunk.kv(name)`, and sets `supports_sequence_chunks = True`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor, nn

__all__ = ["BlockAdapter", "KVExtenderLike", "SequenceChunkLike", "StageLike"]


class KVExtenderLike(Protocol):
    """What attention asks of a sequence chunk (see `pipeblocks.models.gpt.KVExtender`)."""

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]: ...


class SequenceChunkLike(Protocol):
    """What a stage reads of the runtime's `SequenceChunk` (a protocol: models do not import the runtime)."""

    offset: int

    def kv(self, layer: str) -> KVExtenderLike: ...


class StageLike(Protocol):
    """What an adapter reads of the `Stage` it runs (a protocol: the stage runs its adapter)."""

    def part(self, path: str) -> nn.Module: ...


class BlockAdapter:
    """The default convention; subclass and override what your model needs.

    supports_sequence_chunks: whether the blocks can run a slice of the sequence with the
    K/V of earlier slices (Seq1F1B). A stage whose adapter says False refuses `chunk=`.
    """

    supports_sequence_chunks: bool = False

    def run_before(self, name: str, module: nn.Module, x: Any, chunk: SequenceChunkLike | None) -> Any:
        """Stage 0, before the blocks: the input (token ids) to the hidden state."""
        return module(x)

    def context(self, stage: StageLike, h: Any, chunk: SequenceChunkLike | None) -> Any:
        """Once per forward, on the hidden state entering the blocks: what the blocks need beside it."""
        return chunk

    def run_block(self, name: str, block: nn.Module, h: Any, ctx: Any) -> Any:
        return block(h)

    def run_after(self, name: str, module: nn.Module, h: Any, ctx: Any) -> Any:
        """Last stage, after the blocks: hidden state to the output (logits)."""
        return module(h)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
