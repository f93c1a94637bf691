"""Tokenize a corpus once into a memory-mapped token file cached beside it.

    >>> tok = load_tokenizer("models/qwen2")
    >>> cached = tokenize_cached("notes.txt", tok)                  # notes.txt.pbtok/<key>.bin + <key>.json
    >>> cached = tokenize_cached("docs.jsonl", tok, field="body")   # one JSON object a line
    >>> tokens = cached.shard().memmap()                            # uint16 ids, read as needed

The cache is keyed on the input's content (sha256), the tokenizer's identity, the JSONL
field and FORMAT_VERSION, so editing the corpus or changing the tokenizer makes a new
entry and a later load with the same inputs reads the old one. Every document is followed
by the tokenizer's EOS (nothing with a tokenizer without one); a text file is one document,
a JSONL line is one. Ids are uint16 when the vocabulary fits, else uint32.

Tokenizing streams: a text file goes in pieces cut at line starts (so no character, word or
pre-token of a byte-level BPE is cut: the ids are those of the whole text; a tokenizer that
marks the start of a text, as SentencePiece's does, marks each piece's), a JSONL file a batch
of lines at a time; tokens are appended to a
temporary file renamed into place when complete, with its JSON (count, dtype, largest id,
sha256) written last. A cache whose JSON is missing or disagrees with its .bin is built
again, with one line on stderr. Long inputs report progress on stderr every few seconds.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from .datasets_dir import dataset_documents
from .token_file import TokenShard
from .tokenizer import Tokenizer

__all__ = ["CACHE_SUFFIX", "FORMAT_VERSION", "CachedTokens", "corpus_documents", "tokenize_cached"]

FORMAT_VERSION = 1
CACHE_SUFFIX = ".pbtok"
PIECE_BYTES = 1 << 22
"""a text file is read 4 MiB at a time"""
BATCH_CHARS = 1 << 16
"""texts handed to the tokenizer at once are cut to about 64 Ki characters (its threads share a batch)"""
BATCH_DOCS = 1024
PROGRESS_EVERY_S = 5.0
_HASH_BLOCK = 1 << 20


@dataclass(frozen=True)
class CachedTokens:
    """A complete cache entry: its token file and what its JSON records."""

    path: Path
    """the .bin file"""
    tokens: int
    dtype: str
    max_id: int
    eos_id: int | None
    documents: int

    def shard(self) -> TokenShard:
        return TokenShard(self.path, self.dtype, self.tokens)


def tokenize_cached(source: str | Path, tokenizer: Tokenizer, *, field: str = "text", kind: str | None = None,
                    log: TextIO | None = None) -> CachedTokens:
    """The cache entry of `source` tokenized by `tokenizer`, built when absent or damaged.

    kind: "text", "jsonl" or "datasets" (None: "jsonl" for a .jsonl suffix, "datasets" for a
    directory, else "text"). field: the JSONL or datasets field holding the text.
    """
    source = Path(source)
    log = log if log is not None else sys.stderr
    kind = kind or ("datasets" if source.is_dir() else "jsonl" if source.suffix.lower() == ".jsonl" else "text")
    if source.is_file() and source.stat().st_size == 0:
        raise ValueError(f"data file {str(source)!r} is empty: give a file with some content to --data")
    content, size = _content_digest(source, log)
    key = _key(content, tokenizer, field if kind != "text" else "")
    directory = source.parent / (source.name + CACHE_SUFFIX)
    try:
        directory.mkdir(exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot make the token cache {str(directory)!r} beside {str(source)!r}: {err.strerror}; "
                         f"make its directory writable, or tokenize a copy in a writable place") from None
    bin_path, meta_path = directory / f"{key[:16]}.bin", directory / f"{key[:16]}.json"
    with _exclusive(directory / f"{key[:16]}.lock"):  # ranks of one run loading together tokenize once
        cached, why = _read_entry(bin_path, meta_path, key, size)
        if cached is not None:
            return cached
        if why is not None:
            print(f"token cache {str(meta_path)!r} {why}: tokenizing {str(source)!r} again", file=log)
        elif size > PIECE_BYTES:
            print(f"tokenizing {str(source)!r} with {tokenizer.name} (once: cached in {str(directory)!r})", file=log)
        documents = corpus_documents(source, kind, field)
        return _build(documents, tokenizer, bin_path, meta_path, key=key, size=size, source=source,
                      text_file=kind == "text", log=log)


def corpus_documents(source: Path, kind: str, field: str = "text") -> Iterator[tuple[list[str], int]]:
    """(a batch of texts, bytes of the input read so far): a text file's pieces (one document,
    so only the last piece ends it), or a batch of JSONL documents, or of a saved dataset's."""
    if kind == "text":
        return _text_pieces(source)
    if kind == "jsonl":
        return _jsonl_documents(source, field)
    return dataset_documents(source, field, BATCH_DOCS)


def _build(documents, tokenizer: Tokenizer, bin_path: Path, meta_path: Path, *, key: str, size: int, source: Path,
           text_file: bool, log: TextIO) -> CachedTokens:
    """Tokenize `documents` into bin_path (by way of a temporary file), then write its JSON."""
    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    tmp = bin_path.with_name(f"{bin_path.name}.{os.getpid()}.tmp")
    digest, count, max_id, docs = hashlib.sha256(), 0, -1, 0
    progress = _Progress(f"tokenizing {str(source)!r}", size, log)
    try:
        with open(tmp, "wb") as out:
            for texts, done in documents:
                parts, last = _cut_batch(texts)
                ids = tokenizer.encode_batch(parts)
                # each JSONL or dataset text is a document, ended by EOS; a text file's pieces are one
                pieces = [np.asarray(i + eos if ends and not text_file else i, dtype=np.int64)
                          for i, ends in zip(ids, last)]
                docs += 0 if text_file else len(texts)
                chunk = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
                if chunk.size:
                    max_id = max(max_id, int(chunk.max()))
                    data = chunk.astype(dtype).tobytes()
                    out.write(data)
                    digest.update(data)
                    count += chunk.size
                progress.update(done, count)
            if text_file:
                data = np.asarray(eos, dtype=dtype).tobytes()
                out.write(data)
                digest.update(data)
                count, docs = count + len(eos), 1
                max_id = max([max_id, *eos])
            out.flush()
            os.fsync(out.fileno())
        if count == 0:
            raise ValueError(f"{str(source)!r} gives no tokens: give data with some text to --data")
        os.replace(tmp, bin_path)
    finally:
        tmp.unlink(missing_ok=True)
    meta = {"format": FORMAT_VERSION, "key": key, "source": str(source), "source_size": size,
            "tokenizer": tokenizer.name, "tokenizer_identity": tokenizer.identity, "tokens": count, "dtype": dtype,
            "max_id": max_id, "eos_id": tokenizer.eos_id, "documents": docs, "sha256": digest.hexdigest()}
    meta_tmp = meta_path.with_name(f"{meta_path.name}.{os.getpid()}.tmp")
    meta_tmp.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    os.replace(meta_tmp, meta_path)
    progress.finish(count)
    return CachedTokens(bin_path, count, dtype, max_id, tokenizer.eos_id, docs)


def _read_entry(bin_path: Path, meta_path: Path, key: str, size: int) -> tuple[CachedTokens | None, str | None]:
    """(the entry, None) when it is intact; (None, why) when it is there but not to be trusted;
    (None, None) when there is none."""
    if not meta_path.exists() and not bin_path.exists():
        return None, None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        entry = CachedTokens(bin_path, int(meta["tokens"]), str(meta["dtype"]), int(meta["max_id"]),
                             meta["eos_id"], int(meta["documents"]))
        recorded = (meta["key"], int(meta["source_size"]), str(meta["sha256"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None, "is missing or unreadable"
    if recorded[0] != key or entry.dtype not in ("uint16", "uint32"):
        return None, "belongs to other data"
    if recorded[1] != size:
        return None, f"records a source of {recorded[1]} bytes, not {size}"
    itemsize = np.dtype(entry.dtype).itemsize
    if not bin_path.is_file() or bin_path.stat().st_size != entry.tokens * itemsize:
        return None, f"records {entry.tokens} tokens but its .bin is missing or another size"
    if _file_digest(bin_path) != recorded[2]:
        return None, "disagrees with its .bin (sha256)"
    return entry, None


def _key(content: str, tokenizer: Tokenizer, field: str) -> str:
    parts = [FORMAT_VERSION, content, tokenizer.identity, field]
    return hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()


def _content_digest(source: Path, log: TextIO) -> tuple[str, int]:
    """(sha256, size in bytes) of a file, or of a directory's files in name order with their names."""
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    total = sum(p.stat().st_size for p in files)
    digest, done = hashlib.sha256(), 0
    progress = _Progress(f"reading {str(source)!r}", total, log)
    for file in files:
        if source.is_dir():
            digest.update(f"{file.relative_to(source).as_posix()}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as handle:
            while block := handle.read(_HASH_BLOCK):
                digest.update(block)
                done += len(block)
                progress.update(done)
    return digest.hexdigest(), total


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _text_pieces(source: Path) -> Iterator[tuple[list[str], int]]:
    """A text file in pieces of about PIECE_BYTES, each ending at a line start (see _last_cut),
    else, after a line of several pieces, at a space, else anywhere between characters."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    carry, done = "", 0
    with open(source, "rb") as handle:
        while block := handle.read(PIECE_BYTES):
            try:
                text = carry + decoder.decode(block)
            except UnicodeDecodeError as err:
                raise ValueError(_not_utf8(source, done + err.start)) from None
            done += len(block)
            cut = _last_cut(text, force=len(carry) > 4 * PIECE_BYTES)
            if cut:
                yield [text[:cut]], done
            carry = text[cut:]
        try:
            carry += decoder.decode(b"", final=True)
        except UnicodeDecodeError as err:
            raise ValueError(_not_utf8(source, done - len(err.object) + err.start)) from None
    if carry:
        yield [carry], done


def _not_utf8(source: Path, offset: int) -> str:
    return (f"data file {str(source)!r} is not UTF-8 text (near byte {offset}): convert it to UTF-8 "
            f"(e.g. iconv -t UTF-8), or give it without --tokenizer to train on its raw bytes")


def _last_cut(text: str, start: int = 0, end: int | None = None, *, force: bool = False) -> int:
    """Where to end a piece text[start:end]: after its last newline between two non-spaces
    (0: none; with `force`, after its last space, else at `end`). Pre-tokenizers of the GPT-2
    kind never join across such a newline, so the pieces' ids are the whole text's; beside
    spaces they might ("  \n" or "\n\n" can be one pre-token)."""
    end = len(text) if end is None else end
    at = end - 1  # the newline needs its next character inside the piece
    while (at := text.rfind("\n", start, at)) > start:
        if not text[at + 1].isspace() and not text[at - 1].isspace():
            return at + 1
    if force:  # a line longer than several pieces: a space will do, else anywhere
        space = max(text.rfind(" ", start, end), text.rfind("\t", start, end))
        return space + 1 if space > start else end
    return 0


def _cut_batch(texts: list[str]) -> tuple[list[str], list[bool]]:
    """(parts, whether each ends its text): a text over BATCH_CHARS in parts at line starts,
    so the tokenizer's threads share it; cut there, the ids are the whole text's."""
    parts, last = [], []
    for text in texts:
        start = 0
        while len(text) - start > BATCH_CHARS and (cut := _last_cut(text, start, start + BATCH_CHARS)):
            parts.append(text[start:cut])
            last.append(False)
            start = cut
        parts.append(text[start:] if start else text)
        last.append(True)
    return parts, last


def _jsonl_documents(source: Path, field: str) -> Iterator[tuple[list[str], int]]:
    texts, chars, done, seen = [], 0, 0, 0
    with open(source, "rb") as handle:
        for number, line in enumerate(handle, 1):
            done += len(line)
            if not line.strip():
                continue
            texts.append(_jsonl_text(source, number, line, field))
            chars, seen = chars + len(texts[-1]), seen + 1
            if len(texts) >= BATCH_DOCS or chars >= PIECE_BYTES:
                yield texts, done
                texts, chars = [], 0
    if not seen:
        raise ValueError(f"data file {str(source)!r} holds no JSON lines: give a JSONL file with one JSON object "
                         f"per line, or a text file (any suffix but .jsonl)")
    if texts:
        yield texts, done


def _jsonl_text(source: Path, number: int, line: bytes, field: str) -> str:
    where = f"line {number} of {str(source)!r}"
    try:
        record = json.loads(line)
    except ValueError as err:
        raise ValueError(f"{where} is not JSON ({err.msg}): give one JSON object per line") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object with a {field!r} field")
    if field not in record:
        fields = ", ".join(repr(k) for k in list(record)[:8])
        raise ValueError(f"{where} has no field {field!r} (it has {fields or 'none'}): --data-field chooses "
                         f"the field that holds the text")
    text = record[field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {field!r} is a {type(text).__name__}, not text: --data-field chooses "
                         f"the field that holds the text")
    return text


class _Progress:
    """A line on stderr at most every PROGRESS_EVERY_S seconds of a long pass over `total` bytes."""

    def __init__(self, what: str, total: int, log: TextIO) -> None:
        self.what, self.total, self.log = what, total, log
        self.start = self.last = time.monotonic()
        self.spoke = False

    def update(self, done: int, tokens: int | None = None) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last, self.spoke = now, True
        counted = "" if tokens is None else f", {tokens:,} tokens"
        print(f"{self.what}: {done / 2**20:,.0f} of {self.total / 2**20:,.0f} MiB{counted} "
              f"({now - self.start:.0f} s)", file=self.log, flush=True)

    def finish(self, tokens: int) -> None:
        if self.spoke:
            print(f"{self.what}: done, {tokens:,} tokens in {time.monotonic() - self.start:.0f} s", file=self.log)


@contextmanager
def _exclusive(lock: Path):
    """Hold an advisory lock on `lock` (where the platform has one) for the block."""
    try:
        import fcntl  # POSIX only: elsewhere the cache is written without a lock
    except ImportError:  # no advisory locks: concurrent builders each write a whole file and rename it
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
