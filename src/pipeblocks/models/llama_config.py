"""The Llama-style models' shape: a typed, frozen config that imports nothing heavy.

    >>> LlamaConfig(layers=8, hidden=64, heads=4, kv_heads=2, seq=64, vocab=256, dtype="float64")

One config for the built-in Llama (`pipeblocks.models.llama`) and for Hugging Face's
`LlamaForCausalLM` built from it (`pipeblocks.models.hf_llama`), so both families take the
same size options. Kept apart from the models so the command line reads it without torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .config import DTYPES, FamilyConfig, DTypeName

__all__ = ["LlamaConfig"]

@dataclass(frozen=True)
class LlamaConfig(FamilyConfig):
    """Shape of a Llama-style decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention)."""

    layers: int = 8
    """Decoder blocks (the embedding and the head are not counted)."""
    hidden: int = 64
    """Model width h."""
    heads: int = 4
    """Query heads; must divide hidden, and hidden / heads must be even (rotary pairs)."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); must divide heads. None: as many as heads."""
    seq: int = 64
    """Context length: the longest sequence (positions 0..seq-1) the model runs."""
    vocab: int = 256
    """Vocabulary size (256 for the byte tokenizer)."""
    dtype: DTypeName = "float32"
    """Parameter and activation dtype: "float32" or "float64"."""
    intermediate: int | None = None
    """SwiGLU inner width. None: 8/3 of hidden rounded up to a multiple of 8 (Llama's rule)."""
    rope_theta: float = 10000.0
    """Rotary base: frequencies theta^(-2i/d)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        self._check_counts(("layers", "hidden", "heads", "seq", "vocab"), optional=("kv_heads", "intermediate"))
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be a multiple of heads ({self.heads}): "
                f"change --hidden to e.g. {self.heads * 2 * max(1, round(self.hidden / self.heads / 2))} or --heads"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"the head width hidden / heads = {self.hidden} / {self.heads} = {self.head_dim} must be even for "
                f"rotary embeddings: change --hidden to e.g. {self.heads * (self.head_dim + 1)} or --heads"
            )
        if self.heads % self.num_kv_heads:
            divisors = [d for d in range(1, self.heads + 1) if self.heads % d == 0]
            raise ValueError(
                f"kv_heads ({self.num_kv_heads}) must divide heads ({self.heads}) for grouped-query attention: "
                f"use --kv-heads {' or '.join(map(str, divisors))}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a finite number > 0, got {value!r}")

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def intermediate_size(self) -> int:
        if self.intermediate is not None:
            return self.intermediate
        return 8 * math.ceil(8 * self.hidden / 3 / 8)
