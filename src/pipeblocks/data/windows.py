"""A token stream cut into training windows, drawn by (seed, step) alone; `load_tokens`,
the one entry for training data: any corpus a user brings, as memory-mapped token windows.

    >>> data = load_tokens(None, seq=256)                                # the embedded corpus, bytes
    >>> data = load_tokens("notes.txt", seq=256, tokenizer="models/qwen2", vocab=151936)
    >>> data = load_tokens("shards/", seq=1024, dtype="uint32", vocab=151936)    # every *.bin in it
    >>> data = TokenWindows.load(None, seq=64)          # the same as load_tokens(None, seq=64)
    >>> inputs, targets = data.batch(step=0, batch_size=8, seed=0)   # LongTensor [8, 64] each
    >>> train, held = data.split(0.05)      # the last 5% of the tokens never train
    >>> x, y = held.eval_batch(8)           # the same 8 evenly spaced windows every time

The tokens are a LongTensor (the embedded corpus), or a numpy array: a `numpy.memmap` of a
token file (or `token_file.ShardedTokens` of several), of which a batch reads only its
windows and keeps none of the file's pages mapped after (`token_file.release_pages`).
Either way a batch is `batch_size` windows of seq+1 consecutive tokens at offsets that
`torch.randint` draws from a generator seeded by (seed, step) alone: step 17 gets the same
batch whether the run started at step 0 or resumed at step 10, so a checkpoint needs no
data cursor, and the same tokens give the same batches in any storage.

`split` cuts the token stream once: no training window reaches into the held-out tail. When
the stream has document separators (`eos_id`), the cut moves back to just after the last
EOS before it, so no document is split between training and evaluation; it looks back at
most as far as the held-out share is long, and cuts at the token as before when it finds
none (and always without an EOS).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TextIO

import numpy as np
import torch
from torch import Tensor

from .sources import read_tokens
from .text import DEFAULT_SOURCE
from .token_file import release_pages
from .tokenizer import Tokenizer

__all__ = ["MAX_HELD_OUT", "TokenWindows", "load_tokens"]

MAX_HELD_OUT = 0.5
"""the largest share of the corpus `split` holds out"""
_EOS_SEARCH_CHUNK = 1 << 20


@dataclass(frozen=True, eq=False)
class TokenWindows:
    """A token stream cut into training windows of `seq` inputs and `seq` next-token targets."""

    tokens: Tensor | np.ndarray
    """the whole stream: a LongTensor [n], or a 1-D integer numpy array or memmap (or ShardedTokens)"""
    seq: int
    """Window length (inputs and targets each have seq tokens)."""
    source: str = DEFAULT_SOURCE
    """Where the tokens came from, for messages and reports."""
    vocab_size: int = 256
    """the tokenizer's vocabulary (256: bytes)"""
    eos_id: int | None = None
    """the token that ends each document, where the stream has one (`split` cuts after it)"""

    def __post_init__(self) -> None:
        if not isinstance(self.seq, int) or self.seq < 1:
            raise ValueError(f"sequence length must be an integer >= 1, got {self.seq!r}")
        n = self.num_tokens
        if n < self.seq + 1:
            raise ValueError(
                f"{self.source} has {n} tokens but a sequence of {self.seq} needs at least {self.seq + 1}: "
                f"give a longer text (--data) or a shorter sequence (--seq {max(1, n - 1)} or less)"
            )

    @staticmethod
    def load(path: str | os.PathLike | None, *, seq: int) -> TokenWindows:
        """Byte tokens of a text file (None: the embedded corpus), in windows of `seq`; for
        tokenizers, JSONL and token files see `load_tokens`."""
        return load_tokens(path, seq=seq)

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel() if isinstance(self.tokens, Tensor) else len(self.tokens)

    @property
    def num_windows(self) -> int:
        """Distinct window start offsets."""
        return self.num_tokens - self.seq

    def split(self, held_out: float) -> tuple[TokenWindows, TokenWindows | None]:
        """(training windows, held-out windows): the last `held_out` share of the tokens is
        held out (None when that is 0, or too short for one window of seq+1 tokens); with an
        EOS, from the start of a document (see the module doc). Both are views of the tokens."""
        if isinstance(held_out, bool) or not isinstance(held_out, (int, float)) or not 0 <= held_out <= MAX_HELD_OUT:
            raise ValueError(f"--held-out {held_out!r}: give a share of the data in 0 .. {MAX_HELD_OUT:g}")
        n = self.num_tokens
        cut = n - round(n * held_out)
        if cut == n:
            return self, None
        if self.eos_id is not None:
            cut = self._document_cut(cut, lowest=max(self.seq + 1, cut - (n - cut)))
        train = self._part(self.tokens[:cut])
        tail = self.tokens[cut:]
        held = self._part(tail) if n - cut > self.seq else None
        return train, held

    def eval_batch(self, batch_size: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of `batch_size` windows at evenly spaced offsets: the same every
        call (a fixed evaluation set; windows repeat when there are fewer)."""
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        starts = torch.linspace(0, self.num_windows - 1, batch_size).round().long()
        windows = self._windows(starts)
        return windows[:, :-1], windows[:, 1:]

    def batch(self, step: int, batch_size: int, *, seed: int = 0) -> tuple[Tensor, Tensor]:
        """(inputs, targets), LongTensor [batch_size, seq] each; a function of (seed, step) only."""
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        gen = torch.Generator().manual_seed(_mix(seed, step))
        starts = torch.randint(0, self.num_windows, (batch_size,), generator=gen)
        windows = self._windows(starts)
        return windows[:, :-1], windows[:, 1:]

    def _windows(self, starts: Tensor) -> Tensor:
        """LongTensor [len(starts), seq+1]: the windows at `starts`, read and nothing else."""
        index = starts[:, None] + torch.arange(self.seq + 1)
        if isinstance(self.tokens, Tensor):
            return self.tokens[index]
        windows = torch.from_numpy(np.asarray(self.tokens[index.numpy()], dtype=np.int64))
        release_pages(self.tokens)  # else a long run maps most of a large file (token_file's doc)
        return windows

    def _part(self, tokens) -> TokenWindows:
        return TokenWindows(tokens, self.seq, self.source, self.vocab_size, self.eos_id)

    def _document_cut(self, cut: int, lowest: int) -> int:
        """Just after the last EOS among tokens lowest-1 .. cut-1 (searched backwards a chunk
        at a time, so only the pages it needs are read); `cut` itself when there is none."""
        hi = cut
        while hi > lowest - 1:
            lo = max(lowest - 1, hi - _EOS_SEARCH_CHUNK)
            chunk = self.tokens[lo:hi]
            chunk = chunk.numpy() if isinstance(chunk, Tensor) else np.asarray(chunk)
            found = np.flatnonzero(chunk == self.eos_id)
            release_pages(self.tokens)
            if found.size:
                return lo + int(found[-1]) + 1
            hi = lo
        return cut


def load_tokens(path: str | os.PathLike | None, *, seq: int, tokenizer: str | os.PathLike | Tokenizer | None = None,
                field: str = "text", dtype: str = "uint16", vocab: int | None = None,
                log: TextIO | None = None) -> TokenWindows:
    """Windows of `seq` over the tokens of `path`, read by `sources.read_tokens` with the
    other arguments (its doc says what each may be)."""
    stream = read_tokens(path, tokenizer=tokenizer, field=field, dtype=dtype, vocab=vocab, log=log)
    return TokenWindows(stream.tokens, seq, stream.source, stream.vocab_size, stream.eos_id)


def _mix(seed: int, step: int) -> int:
    """One generator seed per (seed, step); distinct seeds do not shift into each other's steps."""
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) % (2**63)
