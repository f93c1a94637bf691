"""How a stage of a Hugging Face decoder runs its parts: the layout and the adapter.

    >>> stages = split_model(model, HF_LAYOUT, 2, adapter=HFDecoderAdapter("sdpa"))

Every supported architecture (Llama, Mistral, Qwen2, Qwen3, Gemma) has these parts:

    before   model.embed_tokens      (Gemma's scales by sqrt(hidden) itself)
    blocks   model.layers            (the decoder layers)
    after    model.norm, lm_head     (lm_head may share embed_tokens' weight: tied)
    shared   model.rotary_emb        (every stage computes cos/sin for its positions)

Each stage calls its decoder layers as the model's own forward does: with
`position_embeddings=(cos, sin)`, `position_ids` and the attention mask. Under SDPA
without a sliding window the mask is None (SDPA's causal flag); otherwise (eager
attention, or a sliding window shorter than the sequence) it is the additive causal mask,
banded to the window. A layer that returns a tuple (older transformers) gives its first
element. Hugging Face attention has no seam for the K/V of earlier sequence chunks, so
these stages refuse `chunk=` (Seq1F1B).
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..adapter import BlockAdapter, SequenceChunkLike
from ..layout import Layout
from ..stage import Stage

__all__ = ["HF_LAYOUT", "HFDecoderAdapter", "MISSING_TRANSFORMERS", "causal_mask", "require_transformers"]

HF_LAYOUT = Layout(blocks="model.layers", before=("model.embed_tokens",), after=("model.norm", "lm_head"),
                   shared=("model.rotary_emb",))

MISSING_TRANSFORMERS = ("Hugging Face models need transformers: pip install -e .[hf] (or pip install transformers "
                        "safetensors)")


def require_transformers() -> Any:
    """The transformers module, or a one-line ValueError saying how to install it."""
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(MISSING_TRANSFORMERS)
    return importlib.import_module("transformers")


class _Context(NamedTuple):
    position_ids: Tensor
    position_embeddings: tuple[Tensor, Tensor]
    mask: Tensor | None


def causal_mask(length: int, dtype: torch.dtype, device: torch.device, window: int | None = None) -> Tensor:
    """Additive mask [1, 1, s, s]: 0 where query i sees key j (j <= i, and i - j < window), else the dtype's minimum."""
    i = torch.arange(length, device=device)
    blocked = i[None, :] > i[:, None]
    if window is not None:
        blocked |= (i[:, None] - i[None, :]) >= window
    mask = torch.zeros(length, length, dtype=dtype, device=device).masked_fill(blocked, torch.finfo(dtype).min)
    return mask[None, None]


class HFDecoderAdapter(BlockAdapter):
    """Calls decoder layers with the rotary cos/sin, positions and attention mask of the stage's tokens.

    sliding_window: the architecture's attention window (Mistral), or None for full causal attention.
    """

    supports_sequence_chunks = False

    def __init__(self, attn_implementation: str = "sdpa", sliding_window: int | None = None) -> None:
        self.attn_implementation = attn_implementation
        self.sliding_window = sliding_window

    def context(self, stage: Stage, h: Tensor, chunk: SequenceChunkLike | None) -> _Context:
        s = h.size(1)
        position_ids = torch.arange(s, device=h.device).unsqueeze(0)
        cos, sin = stage.part("model.rotary_emb")(h, position_ids)
        window = self.sliding_window if self.sliding_window is not None and self.sliding_window < s else None
        mask = None
        if self.attn_implementation != "sdpa" or window is not None:  # SDPA alone is causal when the mask is None
            mask = causal_mask(s, h.dtype, h.device, window)
        return _Context(position_ids, (cos, sin), mask)

    def run_block(self, name: str, block: nn.Module, h: Tensor, ctx: _Context) -> Tensor:
        out = block(h, attention_mask=ctx.mask, position_ids=ctx.position_ids,
                    position_embeddings=ctx.position_embeddings)
        return out[0] if isinstance(out, tuple) else out

    def __repr__(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window is not None else ""
        return f"HFDecoderAdapter({self.attn_implementation!r}{window})"
