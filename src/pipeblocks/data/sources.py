"""Any corpus a user brings, read as one token stream (memory-mapped where it can be);
`windows.load_tokens` cuts it into training windows.

    >>> stream = read_tokens(None)                                       # the embedded corpus, bytes
    >>> stream = read_tokens("notes.txt")                                # its UTF-8 bytes, mapped
    >>> stream = read_tokens("notes.txt", tokenizer="models/qwen2", vocab=151936)
    >>> stream = read_tokens("docs.jsonl", tokenizer=tok, field="body", vocab=32000)
    >>> stream = read_tokens("train.bin", dtype="uint16", vocab=50304)  # nanoGPT's format
    >>> stream = read_tokens("shards/", dtype="uint32", vocab=151936)   # every *.bin in it

What `--data PATH` is, by its form:

    none                        the embedded corpus (`text.default_corpus`), bytes, in memory
    directory with *.bin        token shards, concatenated in name order (token_file)
    directory from save_to_disk a Hugging Face dataset, its `field` tokenized once (datasets_dir)
    FILE.bin                    a token file of `dtype` ids (token_file)
    FILE.jsonl                  one JSON document a line, its `field` tokenized once (tokenize)
    any other file              text: its bytes as they are without a tokenizer; tokenized once with one

Without a tokenizer a text file's tokens are its bytes, mapped from the file itself (no
copy, no cache): the batches are those of reading it whole. Everything tokenized is cached
beside its source (`tokenize.tokenize_cached`); token files are read as they are.

`vocab` is the model's vocabulary: a tokenizer larger than it, or a token id at or beyond
it, is refused in one line. A token file is scanned for its largest id a chunk at a time; a
tokenized cache records its largest id, so it is not scanned again.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import numpy as np
import torch

from .datasets_dir import is_dataset_dir
from .text import DEFAULT_SOURCE, default_corpus
from .token_file import SHARD_SUFFIX, TokenShard, first_token_at_least, open_tokens, scan_chunks, token_shards
from .tokenize import tokenize_cached
from .tokenizer import BYTES, Tokenizer, check_tokenizer_fits, load_tokenizer

__all__ = ["TokenStream", "read_tokens", "source_kind"]


class TokenStream(NamedTuple):
    """What a corpus holds: its tokens, a name for messages, its vocabulary and its EOS."""

    tokens: Any
    """a LongTensor [n] (the embedded corpus), or a 1-D integer numpy array, memmap or ShardedTokens"""
    source: str
    vocab_size: int = BYTES.vocab_size
    eos_id: int | None = None


def read_tokens(path: str | os.PathLike | None, *, tokenizer: str | os.PathLike | Tokenizer | None = None,
                field: str = "text", dtype: str = "uint16", vocab: int | None = None,
                log: TextIO | None = None) -> TokenStream:
    """The tokens of `path` (see the module doc for what it may be).

    tokenizer: None (bytes), a model or tokenizer directory, a tokenizer.json, or a loaded
    `Tokenizer`; it tokenizes text, JSONL and datasets, and gives a token file its EOS for
    `split`. field: the JSONL or dataset field holding each document's text. dtype: the ids
    of a token file, "uint16" or "uint32". vocab: the model's vocabulary, checked when given.
    log: where progress and cache messages go (stderr).
    """
    kind = None if path is None else source_kind(Path(path))
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    is_bytes = tok.backend is None
    if vocab is not None and not (kind == "tokens" and is_bytes):
        check_tokenizer_fits(tok, vocab)  # a token file without a tokenizer is checked by its ids alone
    if path is None:
        return _embedded(tok)
    file = Path(path)
    if kind == "tokens":
        return _token_file(file, None if is_bytes else tok, dtype, vocab)
    if kind == "text" and is_bytes:
        return TokenStream(_text_bytes(file), str(path), BYTES.vocab_size)
    cached = tokenize_cached(file, tok, field=field, kind=kind, log=log if log is not None else sys.stderr)
    if vocab is not None and cached.max_id >= vocab:
        raise ValueError(_beyond(cached.max_id, None, str(path), vocab, cached.dtype))
    return TokenStream(cached.shard().memmap(), str(path), tok.vocab_size, cached.eos_id)


def source_kind(path: Path) -> str:
    """"tokens", "datasets", "jsonl" or "text": how `read_tokens` reads `path`. Raises
    ValueError for a path that is none of them."""
    if path.is_dir():
        if is_dataset_dir(path):
            return "datasets"
        if any(p.suffix == SHARD_SUFFIX and p.is_file() for p in path.iterdir()):
            return "tokens"
        raise ValueError(f"data path {str(path)!r} is not a file and holds no {SHARD_SUFFIX} token shards: give a "
                         f"text, JSONL or token file to --data, or a directory of {SHARD_SUFFIX} shards or a saved "
                         f"dataset")
    if not path.exists():
        raise ValueError(f"data file {str(path)!r} does not exist: give an existing text file to --data")
    if not path.is_file():
        raise ValueError(f"data path {str(path)!r} is not a file: give a text file to --data")
    suffix = path.suffix.lower()
    return "tokens" if suffix == SHARD_SUFFIX else "jsonl" if suffix == ".jsonl" else "text"


def _embedded(tok: Tokenizer) -> TokenStream:
    data = default_corpus()
    if tok.backend is None:  # as always: the bytes, in memory
        return TokenStream(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long), DEFAULT_SOURCE)
    # about 460 kB: tokenized in memory, one document (nowhere to cache beside the interpreter's files)
    ids = tok.encode(data.decode("utf-8")) + ([] if tok.eos_id is None else [tok.eos_id])
    return TokenStream(np.asarray(ids, dtype=np.int64), DEFAULT_SOURCE, tok.vocab_size, tok.eos_id)


def _text_bytes(file: Path) -> np.memmap:
    """A text file's bytes as uint8 tokens, mapped (what reading it whole gave, without doing so)."""
    try:
        size = file.stat().st_size
        if size == 0:
            raise ValueError(f"data file {str(file)!r} is empty: give a text file with some content to --data")
        return TokenShard(file, "uint8", size).memmap()
    except OSError as err:
        raise ValueError(f"cannot read data file {str(file)!r}: {err.strerror}") from None


def _token_file(path: Path, tok: Tokenizer | None, dtype: str, vocab: int | None) -> TokenStream:
    shards = token_shards(path, dtype)
    if vocab is not None:
        bad = first_token_at_least(shards, vocab)
        if bad is not None:
            shard, at, token = bad
            raise ValueError(_beyond(token, at, str(shard.path), vocab, dtype))
        vocab_size = tok.vocab_size if tok is not None else vocab
    elif tok is not None:
        vocab_size = tok.vocab_size
    else:  # nothing says how large the vocabulary is: the ids say
        vocab_size = max(int(view.max()) for _, _, view in scan_chunks(shards)) + 1
    return TokenStream(open_tokens(shards), str(path), vocab_size, None if tok is None else tok.eos_id)


def _beyond(token: int, at: int | None, where: str, vocab: int, dtype: str) -> str:
    place = f"at token {at} of {where}" if at is not None else f"in {where}"
    hint = (", or --data-dtype uint16 if the file holds uint16 ids" if dtype == "uint32" and token >= 1 << 16
            else ", or a model with a larger vocabulary")
    return (f"token id {token} {place} is beyond the model's vocabulary of {vocab}: tokenize with the model's "
            f"tokenizer (--tokenizer MODEL_DIR){hint}")
