"""Text as bytes: a byte tokenizer and the embedded corpus.

    >>> ByteTokenizer.encode("hi")                 # tensor([104, 105])
    >>> data, name = read_corpus(None)             # the embedded corpus, whole: (bytes, "pydoc_data.topics")

Tokens are UTF-8 bytes (vocab 256), so any file works and nothing is trained. The default
corpus is `pydoc_data.topics`, the help text that ships with CPython (about 460 kB), joined
in sorted-key order. Training windows over a text file (memory-mapped: its bytes are the
tokens), and tokenizers, JSONL, saved datasets and pre-tokenized files, enter through
`pipeblocks.data.load_tokens` (windows.py, reading through sources.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

__all__ = ["ByteTokenizer", "DEFAULT_SOURCE", "default_corpus", "read_corpus"]

DEFAULT_SOURCE = "pydoc_data.topics"
"""the embedded corpus's name, in messages and reports"""


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
    from pydoc_data.topics import topics  # about 460 kB of text: loaded when the corpus is used

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
