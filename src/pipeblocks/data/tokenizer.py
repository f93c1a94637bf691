"""Tokenizers for training data: UTF-8 bytes, or a Hugging Face tokenizer.json read locally.

    >>> tok = load_tokenizer(None)                      # bytes: vocabulary 256, no EOS
    >>> tok = load_tokenizer("models/qwen2")            # a model or tokenizer directory
    >>> tok = load_tokenizer("models/qwen2/tokenizer.json")
    >>> tok.encode("hello"), tok.eos_id, tok.vocab_size
    >>> check_tokenizer_fits(tok, vocab=32000)          # one line when the model's embedding is smaller

A directory must hold tokenizer.json (what a "fast" tokenizer's `save_pretrained` writes); it
is read with the `tokenizers` library, and nothing is ever downloaded. The end-of-document
token (EOS), which the data layer puts after every document, is tokenizer_config.json's
"eos_token", else config.json's or generation_config.json's "eos_token_id" beside it, else
there is none.

Text is encoded without the tokenizer's special-token template (no BOS added per piece):
training text is one long stream, and documents are told apart by the EOS alone.

`identity` names the tokenizer for cache keys: the sha256 of tokenizer.json and the EOS id,
so a token cache made with one tokenizer is never read with another.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BYTE_VOCAB", "Tokenizer", "check_tokenizer_fits", "load_tokenizer"]

BYTE_VOCAB = 256
TOKENIZER_FILE = "tokenizer.json"
# files that hold a tokenizer a fast one can be converted from, for the error's hint
_SLOW_FILES = ("tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model")


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """Text <-> token ids; `backend` is a `tokenizers.Tokenizer`, or None for UTF-8 bytes."""

    name: str
    """what messages call it: "bytes", or the path it was read from"""
    vocab_size: int
    """ids are in 0 .. vocab_size-1 (the embedding the model needs)"""
    eos_id: int | None
    """the token that ends a document, or None (then documents are simply concatenated)"""
    identity: str
    """a stable digest of what tokenizes: cache keys include it"""
    backend: Any = field(default=None, repr=False)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""
        if self.backend is None:
            return list(text.encode("utf-8"))
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text; a Hugging Face tokenizer spreads the batch over the cores."""
        if self.backend is None:
            return [list(text.encode("utf-8")) for text in texts]
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets nobody reads here
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        """The text of `ids` (a list, an array or a tensor of ints)."""
        values = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        if self.backend is None:
            return bytes(values).decode("utf-8", errors="replace")
        return self.backend.decode(values, skip_special_tokens=False)


BYTES = Tokenizer("bytes", BYTE_VOCAB, None, "bytes")


def load_tokenizer(source: str | Path | None) -> Tokenizer:
    """The byte tokenizer (None), or the tokenizer of a directory holding tokenizer.json or of
    a tokenizer.json file. Raises ValueError (one line, with the fix) when it cannot be read."""
    if source is None:
        return BYTES
    path = Path(source)
    if not path.exists():
        raise ValueError(f"tokenizer {str(source)!r} does not exist: give a model or tokenizer directory holding "
                         f"{TOKENIZER_FILE}, or a {TOKENIZER_FILE} file, to --tokenizer")
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if path.is_dir() and not file.is_file():
        raise ValueError(_missing_file_message(path))
    try:
        import tokenizers  # optional (the hf extra)
    except ImportError:
        raise ValueError(f"--tokenizer {str(source)!r} needs the tokenizers library: pip install -e .[hf]") from None
    try:
        raw = file.read_bytes()
        backend = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except OSError as err:
        raise ValueError(f"cannot read tokenizer file {str(file)!r}: {err.strerror}") from None
    except Exception as err:  # the library raises a bare Exception for a malformed file
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"tokenizer file {str(file)!r} is not a tokenizer.json the tokenizers library reads "
                         f"({first}): give the {TOKENIZER_FILE} that save_pretrained writes") from None
    vocab = backend.get_vocab(with_added_tokens=True)
    # ids need not be dense: the embedding must reach the largest one
    vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
    eos = _eos_id(file.parent, vocab)
    digest = hashlib.sha256(raw).hexdigest()
    return Tokenizer(str(path), vocab_size, eos, f"sha256:{digest}/eos:{eos}", backend)


def check_tokenizer_fits(tokenizer: Tokenizer, vocab: int) -> None:
    """One line when `tokenizer` makes ids that the model's vocabulary of `vocab` cannot embed."""
    if tokenizer.vocab_size > vocab:
        raise ValueError(
            f"the tokenizer {tokenizer.name} has a vocabulary of {tokenizer.vocab_size} but the model's is {vocab}: "
            f"give the model's own tokenizer (--tokenizer MODEL_DIR), or a model with a vocabulary of at least "
            f"{tokenizer.vocab_size}"
        )


def _missing_file_message(directory: Path) -> str:
    slow = [name for name in _SLOW_FILES if (directory / name).is_file()]
    if slow:
        return (f"tokenizer directory {str(directory)!r} has {slow[0]} but no {TOKENIZER_FILE} (a slow-only "
                f"tokenizer): convert it once with transformers.AutoTokenizer.from_pretrained(DIR)"
                f".save_pretrained(DIR), which writes {TOKENIZER_FILE}")
    return (f"tokenizer directory {str(directory)!r} has no {TOKENIZER_FILE}: give a model or tokenizer directory "
            f"that save_pretrained wrote, or the {TOKENIZER_FILE} file itself")


def _eos_id(directory: Path, vocab: dict[str, int]) -> int | None:
    """tokenizer_config.json's eos_token, else config.json's or generation_config.json's eos_token_id."""
    config = _read_json(directory / "tokenizer_config.json")
    token = config.get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and token in vocab:
        return vocab[token]
    for name in ("config.json", "generation_config.json"):
        value = _read_json(directory / name).get("eos_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def _read_json(path: Path) -> dict:
    """A side file's JSON object; {} when it is absent or unreadable (EOS is then looked for elsewhere)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
