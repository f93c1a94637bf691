"""Pre-tokenized token files: flat little-endian uint16 or uint32 ids, memory-mapped.

    >>> tokens = open_tokens("train.bin", dtype="uint16")    # numpy.memmap, nothing read yet
    >>> tokens = open_tokens("shards/", dtype="uint32")      # every *.bin in name order, as one stream
    >>> len(tokens), tokens[1000:1010], tokens[np.array([[0, 1], [5, 6]])]
    >>> first_token_at_least(token_shards("train.bin", "uint16"), 32000)   # (file, position, id) or None

This is the format nanoGPT's `prepare.py` writes (`np.array(ids, dtype=np.uint16).tofile(f)`):
no header, so the dtype must be told (pipeblocks train --data-dtype, uint16 by default).
A directory of shards reads as their concatenation, in sorted file-name order; a window may
span two shards.

Nothing is read whole: the tokens are a `numpy.memmap` (a `ShardedTokens` of them for
several shards), a batch reads only its windows, and `first_token_at_least` scans a chunk
at a time through a mapping it drops after each chunk, so a scan of a large file leaves
no pages resident in the process. A file page once read stays mapped, and counts in the
process's resident memory, until the mapping lets it go: the kernel maps a cached file a
large folio (up to 2 MiB) at a time, so a few hundred random windows would map most of a
1 GiB file. `release_pages` lets them go after each read; the page cache keeps them, so the
next read costs no disk access.
"""
from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "SCAN_CHUNK", "TOKEN_DTYPES", "ShardedTokens", "TokenShard", "first_token_at_least", "open_tokens",
    "release_pages", "scan_chunks", "token_shards",
]

TOKEN_DTYPES = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""the dtypes a token file may hold (uint8: the bytes of a text file, for the byte tokenizer)"""
SHARD_SUFFIX = ".bin"
SCAN_CHUNK = 1 << 23
"""tokens per chunk of a scan (16 MiB of uint16)"""


@dataclass(frozen=True)
class TokenShard:
    """One token file: where it is, how its ids are stored, and how many there are."""

    path: Path
    dtype: str
    count: int

    def memmap(self, start: int = 0, stop: int | None = None) -> np.memmap:
        """Tokens start .. stop of the file, mapped read-only."""
        stop = self.count if stop is None else stop
        itemsize = TOKEN_DTYPES[self.dtype].itemsize
        return np.memmap(self.path, dtype=TOKEN_DTYPES[self.dtype], mode="r", offset=start * itemsize,
                         shape=(stop - start,))


def token_shards(path: str | Path, dtype: str) -> tuple[TokenShard, ...]:
    """The shards of a token file (one) or a directory of *.bin files, each checked: not
    empty, and a whole number of `dtype` ids. Raises ValueError naming the file and the fix."""
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"--data-dtype {dtype!r}: give uint16 or uint32 (how the token file stores its ids)")
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == SHARD_SUFFIX and p.is_file())
        if not files:
            raise ValueError(f"data directory {str(path)!r} holds no {SHARD_SUFFIX} token shards: give a directory of "
                             f"token files (*{SHARD_SUFFIX}), or a text, JSONL or token file, to --data")
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"token file {str(path)!r} does not exist: give an existing file to --data")
    return tuple(_shard(file, dtype) for file in files)


def _shard(file: Path, dtype: str) -> TokenShard:
    size = file.stat().st_size
    itemsize = TOKEN_DTYPES[dtype].itemsize
    if size == 0:
        raise ValueError(f"token file {str(file)!r} is empty: give a file of token ids (or drop it from the directory)")
    if size % itemsize:
        other = "uint32" if dtype == "uint16" else "uint16"
        hint = f"the file holds {other} ids (--data-dtype {other}) or is damaged" if dtype != "uint8" else "damaged"
        raise ValueError(f"token file {str(file)!r} has {size} bytes, not a whole number of {dtype} ids "
                         f"({itemsize} bytes each): {hint}; write it again, or give the dtype it was written with")
    return TokenShard(file, dtype, size // itemsize)


def open_tokens(shards: tuple[TokenShard, ...]) -> np.memmap | ShardedTokens:
    """The shards' tokens as one read-only stream: a memmap for one shard, a ShardedTokens for several."""
    maps = tuple(shard.memmap() for shard in shards)
    return maps[0] if len(maps) == 1 else ShardedTokens(maps)


@dataclass(frozen=True, eq=False)
class ShardedTokens:
    """Memory-mapped token arrays read as their concatenation: len, a slice (a view, no copy)
    and an integer index array (the gathered ids, an ndarray) work as on one array."""

    parts: tuple[np.ndarray, ...]
    starts: np.ndarray = field(init=False, repr=False)
    """where each part begins in the stream, and the stream's length last"""

    def __post_init__(self) -> None:
        if not self.parts or any(len(part) == 0 for part in self.parts):
            raise ValueError("ShardedTokens needs at least one part and no empty part")
        object.__setattr__(self, "starts", np.cumsum([0] + [len(part) for part in self.parts], dtype=np.int64))

    @property
    def dtype(self) -> np.dtype:
        return np.result_type(*self.parts)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self._slice(key)
        index = np.asarray(key)
        if index.dtype.kind not in "iu":
            raise TypeError(f"ShardedTokens takes a slice or an integer index array, not {index.dtype}")
        flat = index.reshape(-1)
        out = np.empty(flat.shape, dtype=self.dtype)
        part = np.searchsorted(self.starts, flat, side="right") - 1
        for p in np.unique(part):
            where = part == p
            out[where] = self.parts[p][flat[where] - self.starts[p]]
        return out.reshape(index.shape)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The parts joined (a copy: for a short slice, such as a search window)."""
        joined = np.concatenate(self.parts)
        return joined if dtype is None else joined.astype(dtype)

    def _slice(self, key: slice):
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("ShardedTokens slices take step 1")
        stop = max(start, stop)
        views = []
        for p, part in enumerate(self.parts):
            lo, hi = max(start, int(self.starts[p])), min(stop, int(self.starts[p + 1]))
            if lo < hi:
                views.append(part[lo - self.starts[p]:hi - self.starts[p]])
        if len(views) == 1:
            return views[0]
        return ShardedTokens(tuple(views)) if views else self.parts[0][:0]


def release_pages(tokens) -> None:
    """Unmap the file pages that reads of `tokens` (a memmap, or ShardedTokens) brought into
    this process; nothing for arrays in memory, or where the platform cannot."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    for part in tokens.parts if isinstance(tokens, ShardedTokens) else (tokens,):
        handle = getattr(part, "_mmap", None)  # numpy.memmap's mapping; views share their file's
        if handle is not None:
            try:
                handle.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):  # a closed mapping: nothing resident to release
                pass


def scan_chunks(shards: tuple[TokenShard, ...], chunk: int = SCAN_CHUNK) -> Iterator[tuple[TokenShard, int, np.memmap]]:
    """(shard, first position, tokens) a chunk at a time, each through its own mapping,
    dropped when the caller moves on: a scan holds at most one chunk resident."""
    for shard in shards:
        for start in range(0, shard.count, chunk):
            view = shard.memmap(start, min(shard.count, start + chunk))
            yield shard, start, view
            del view


def first_token_at_least(shards: tuple[TokenShard, ...], limit: int,
                         chunk: int = SCAN_CHUNK) -> tuple[TokenShard, int, int] | None:
    """(shard, position in it, id) of the first id >= `limit`, or None when every id is below it."""
    for shard, start, view in scan_chunks(shards, chunk):
        if int(view.max()) >= limit:
            at = int(np.argmax(view >= limit))
            return shard, start + at, int(view[at])
    return None
