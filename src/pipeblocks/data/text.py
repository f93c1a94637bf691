"""Text as bytes: a byte tokenizer, the embedded corpus, and token windows over a text file.

    >>> data = TokenWindows.load(None, seq=64)          # Python's own help topics, no download
    >>> inputs, targets = data.batch(step=0, batch_size=8, seed=0)   # LongTensor [8, 64] each
    >>> data = TokenWindows.load("notes.txt", seq=64)   # any text file (pipeblocks train --data FILE)

Tokens are the file's UTF-8 bytes (vocab 256), so any file works and nothing is trained.
The default corpus is `pydoc_data.topics`, the help text that ships with CPython (about
460 kB), joined in sorted-key order. A text file is memory-mapped, not read: its bytes are
the tokens. Tokenizers, JSONL, saved datasets and pre-tokenized files enter through
`pipeblocks.data.load_tokens` (sources.py).

A batch is `batch_size` windows of seq+1 consecutive tokens at offsets drawn from a
generator seeded by (seed, step) alone: step 17 gets the same batch whether the run
started at step 0 or resumed at step 10, so a checkpoint needs no data cursor.

    >>> train, held = data.split(0.05)      # the last 5% of the tokens never train
    >>> x, y = held.eval_batch(8)           # the same 8 evenly spaced windows every time

`split` cuts the token stream once, at a token boundary: no training window reaches into
the held-out tail, whose windows `eval_batch` takes for the held-out loss (windows.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from .windows import DEFAULT_SOURCE, MAX_HELD_OUT, TokenWindows

__all__ = ["ByteTokenizer", "MAX_HELD_OUT", "TokenWindows", "default_corpus", "read_corpus"]


class ByteTokenizer:
    """UTF-8 bytes as tokens: encode(text) -> ids in 0..255, decode(ids) -> text."""

    vocab_size: ClassVar[int] = 256

    @staticmethod
    def encode(text: str | bytes) -> Tensor:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)

    @staticmethod
    def decode(ids: Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        return bytes(values).decode("utf-8", errors="replace")


def default_corpus() -> bytes:
    """The embedded corpus: CPython's pydoc topics, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def read_corpus(path: str | os.PathLike | None) -> tuple[bytes, str]:
    """(raw bytes, a name for messages) of `path`, or of the default corpus when None (whole,
    in memory: for small files; training maps the file instead, see `load_tokens`)."""
    if path is None:
        return default_corpus(), DEFAULT_SOURCE
    file = Path(path)
    if not file.exists():
        raise ValueError(f"data file {str(path)!r} does not exist: give an existing text file to --data")
    if not file.is_file():
        raise ValueError(f"data path {str(path)!r} is not a file: give a text file to --data")
    try:
        data = file.read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read data file {str(path)!r}: {err.strerror}") from None
    if not data:
        raise ValueError(f"data file {str(path)!r} is empty: give a text file with some content to --data")
    return data, str(path)
