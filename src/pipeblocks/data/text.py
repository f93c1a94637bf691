"""Text for the reference GPT: a byte tokenizer and fixed-length token windows.

    >>> data = TokenWindows.load(None, seq=64)          # Python's own help topics, no download
    >>> inputs, targets = data.batch(step=0, batch_size=8, seed=0)   # LongTensor [8, 64] each
    >>> data = TokenWindows.load("notes.txt", seq=64)   # any text file (pipeblocks train --data FILE)

Tokens are the file's UTF-8 bytes (vocab 256), so any file works and nothing is trained.
The default corpus is `pydoc_data.topics`, the help text that ships with CPython (about
460 kB), joined in sorted-key order.

A batch is `batch_size` windows of seq+1 consecutive tokens at offsets drawn from a
generator seeded by (seed, step) alone: step 17 gets the same batch whether the run
started at step 0 or resumed at step 10, so a checkpoint needs no data cursor.

    >>> train, held = data.split(0.05)      # the last 5% of the tokens never train
    >>> x, y = held.eval_batch(8)           # the same 8 evenly spaced windows every time

`split` cuts the token stream once, at a token boundary: no training window reaches into
the held-out tail, whose windows `eval_batch` takes for the held-out loss.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

__all__ = ["ByteTokenizer", "MAX_HELD_OUT", "TokenWindows", "default_corpus", "read_corpus"]

DEFAULT_SOURCE = "pydoc_data.topics"
MAX_HELD_OUT = 0.5
"""the largest share of the corpus `split` holds out"""


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
    """(raw bytes, a name for messages) of `path`, or of the default corpus when None."""
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


@dataclass(frozen=True, eq=False)
class TokenWindows:
    """A token stream cut into training windows of `seq` inputs and `seq` next-token targets."""

    tokens: Tensor
    """LongTensor [n], the whole corpus."""
    seq: int
    """Window length (inputs and targets each have seq tokens)."""
    source: str = DEFAULT_SOURCE
    """Where the tokens came from, for messages and reports."""
    vocab_size: int = field(default=ByteTokenizer.vocab_size)

    def __post_init__(self) -> None:
        if not isinstance(self.seq, int) or self.seq < 1:
            raise ValueError(f"sequence length must be an integer >= 1, got {self.seq!r}")
        n = self.tokens.numel()
        if n < self.seq + 1:
            raise ValueError(
                f"{self.source} has {n} tokens but a sequence of {self.seq} needs at least {self.seq + 1}: "
                f"give a longer text (--data) or a shorter sequence (--seq {max(1, n - 1)} or less)"
            )

    @staticmethod
    def load(path: str | os.PathLike | None, *, seq: int) -> TokenWindows:
        """Byte tokens of a text file (None: the embedded corpus), in windows of `seq`."""
        data, source = read_corpus(path)
        return TokenWindows(ByteTokenizer.encode(data), seq, source)

    @property
    def num_windows(self) -> int:
        """Distinct window start offsets."""
        return self.tokens.numel() - self.seq

    def split(self, held_out: float) -> tuple[TokenWindows, TokenWindows | None]:
        """(training windows, held-out windows): the last `held_out` share of the tokens is
        held out (None when that is 0, or too short for one window of seq+1 tokens)."""
        if isinstance(held_out, bool) or not isinstance(held_out, (int, float)) or not 0 <= held_out <= MAX_HELD_OUT:
            raise ValueError(f"--held-out {held_out!r}: give a share of the data in 0 .. {MAX_HELD_OUT:g}")
        n = self.tokens.numel()
        cut = n - round(n * held_out)
        if cut == n:
            return self, None
        train = TokenWindows(self.tokens[:cut], self.seq, self.source, self.vocab_size)
        tail = self.tokens[cut:]
        held = TokenWindows(tail, self.seq, self.source, self.vocab_size) if tail.numel() > self.seq else None
        return train, held

    def eval_batch(self, batch_size: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of `batch_size` windows at evenly spaced offsets: the same every
        call (a fixed evaluation set; windows repeat when there are fewer)."""
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        starts = torch.linspace(0, self.num_windows - 1, batch_size).round().long()
        windows = self.tokens[starts[:, None] + torch.arange(self.seq + 1)]
        return windows[:, :-1], windows[:, 1:]

    def batch(self, step: int, batch_size: int, *, seed: int = 0) -> tuple[Tensor, Tensor]:
        """(inputs, targets), LongTensor [batch_size, seq] each; a function of (seed, step) only."""
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        gen = torch.Generator().manual_seed(_mix(seed, step))
        starts = torch.randint(0, self.num_windows, (batch_size,), generator=gen)
        index = starts[:, None] + torch.arange(self.seq + 1)
        windows = self.tokens[index]
        return windows[:, :-1], windows[:, 1:]


def _mix(seed: int, step: int) -> int:
    """One generator seed per (seed, step); distinct seeds do not shift into each other's steps."""
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) % (2**63)
