"""The run's corpus, as `prepare` and every rank load it: one function, so both see the same tokens.

    >>> data = load_corpus(DataSpec("notes.jsonl", tokenizer="models/qwen2"), seq=256, vocab=151936)

The tokenizer is `--tokenizer`'s, else the `--hf` directory's own, else UTF-8 bytes. The
ids are checked against the model's vocabulary, and a tokenizer larger than it is refused.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .config import DataSpec

if TYPE_CHECKING:
    from ..data import TokenWindows

__all__ = ["load_corpus", "tokenizer_source"]


def tokenizer_source(data: DataSpec, model_tokenizer: str | None = None) -> str | None:
    """The tokenizer a run uses: --tokenizer's, else the model directory's, else None (bytes)."""
    return data.tokenizer if data.tokenizer is not None else model_tokenizer


def load_corpus(data: DataSpec, *, seq: int, vocab: int, model_tokenizer: str | None = None) -> TokenWindows:
    """Windows of `seq` tokens over the run's corpus (`data.load_tokens`: tokenized once and
    cached, memory-mapped), every id checked against the model's vocabulary `vocab`."""
    from ..data import load_tokens

    return load_tokens(data.path, seq=seq, tokenizer=tokenizer_source(data, model_tokenizer), field=data.field,
                       dtype=data.dtype, vocab=vocab)
