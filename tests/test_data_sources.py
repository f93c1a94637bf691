"""Users' corpora: tokenizers, token files and shards, the tokenize-once cache, JSONL, saved
datasets, the vocabulary checks, and the held-out cut at a document boundary."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeblocks.data import (
    ShardedTokens, TokenWindows, check_tokenizer_fits, default_corpus, load_tokenizer, load_tokens,
)
from pipeblocks.data import tokenize as tokenize_module
from pipeblocks.data.token_file import first_token_at_least, token_shards
from pipeblocks.data.tokenizer import Tokenizer

pytestmark = pytest.mark.torch


def old_batch(tokens: torch.Tensor, seq: int, step: int, batch_size: int, seed: int = 0):
    """The batch as TokenWindows drew it before token files existed (a LongTensor in memory)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) % (2**63)
    gen = torch.Generator().manual_seed(mixed)
    starts = torch.randint(0, tokens.numel() - seq, (batch_size,), generator=gen)
    windows = tokens[starts[:, None] + torch.arange(seq + 1)]
    return windows[:, :-1], windows[:, 1:]


def as_long(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    from _hf_dirs import make_tokenizer_dir

    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return load_tokenizer(tok_dir)


def text_of(chars: int) -> str:
    from _hf_dirs import corpus_text

    return corpus_text(chars)


def write_tokens(path: Path, ids, dtype: str) -> Path:
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


# -- bytes: what every run without a tokenizer trained on stays the same --------------------------------


def test_embedded_corpus_batches_split_and_eval_are_unchanged():
    old = as_long(default_corpus())
    data = load_tokens(None, seq=32)
    assert isinstance(data.tokens, torch.Tensor) and torch.equal(data.tokens, old) and data.eos_id is None
    for step in (0, 7, 123):
        assert same(data.batch(step, 16, seed=3), old_batch(old, 32, step, 16, seed=3))
    train, held = data.split(0.05)
    cut = old.numel() - round(old.numel() * 0.05)
    assert train.num_tokens == cut and torch.equal(held.tokens, old[cut:])
    assert same(train.batch(5, 8, seed=0), old_batch(old[:cut], 32, 5, 8))


def test_text_file_bytes_are_mapped_and_give_the_same_batches(tmp_path):
    path = tmp_path / "notes.txt"
    raw = ("héllo wörld → " * 3000 + "end\n").encode()
    path.write_bytes(raw)
    data = load_tokens(path, seq=64)
    assert isinstance(data.tokens, np.memmap) and data.tokens.dtype == np.uint8 and data.num_tokens == len(raw)
    assert data.source == str(path) and data.vocab_size == 256 and not (tmp_path / "notes.txt.pbtok").exists()
    old = as_long(raw)
    for step in (0, 1, 99):
        x, y = data.batch(step, 32, seed=11)
        assert x.dtype == torch.long and x.shape == (32, 64)
        assert same((x, y), old_batch(old, 64, step, 32, seed=11))
    train, held = data.split(0.1)
    cut = len(raw) - round(len(raw) * 0.1)
    assert isinstance(train.tokens, np.memmap) and isinstance(held.tokens, np.memmap)
    assert train.num_tokens == cut and same(train.batch(2, 4), old_batch(old[:cut], 64, 2, 4))
    windows = held.eval_batch(5)
    starts = torch.linspace(0, len(raw) - cut - 65, 5).round().long()
    expected = old[cut:][starts[:, None] + torch.arange(65)]
    assert same(windows, (expected[:, :-1], expected[:, 1:]))
    assert TokenWindows.load(path, seq=64).num_tokens == len(raw)  # the old entry reads the same way
    given = load_tokens(path, seq=64, tokenizer=load_tokenizer(None))  # the byte tokenizer, given: the same
    assert isinstance(given.tokens, np.memmap) and given.tokens.dtype == np.uint8
    assert not (tmp_path / "notes.txt.pbtok").exists()


# -- tokenizers --------------------------------------------------------------------------------------


def test_tokenizer_from_directory_or_file_with_eos(tok_dir, tok):
    from _hf_dirs import EOS, TOKENIZER_VOCAB

    assert tok.vocab_size == TOKENIZER_VOCAB and tok.eos_id == tok.backend.token_to_id(EOS)
    assert tok.decode(tok.encode("def f(x): return x")) == "def f(x): return x"
    again = load_tokenizer(tok_dir / "tokenizer.json")
    assert again.identity == tok.identity and again.eos_id == tok.eos_id
    byte = load_tokenizer(None)
    assert (byte.vocab_size, byte.eos_id, byte.encode("é"), byte.decode([104, 105])) == (256, None, [195, 169], "hi")


def test_eos_falls_back_to_config_json_and_otherwise_is_none(tmp_path, tok_dir):
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    none = load_tokenizer(lone)
    assert none.eos_id is None
    (lone / "config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    seven = load_tokenizer(lone)
    assert seven.eos_id == 7 and seven.identity != none.identity  # the EOS is part of what tokenizes


def test_tokenizer_errors_name_the_path_and_the_fix(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers", reason="needs tokenizers (pip install -e .[hf])")
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"slow.*tokenizer.model.*save_pretrained\(DIR\)"):
        load_tokenizer(slow)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json.*not a tokenizer.json"):
        load_tokenizer(bad)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ValueError, match=r"pip install -e \.\[hf\]"):
        load_tokenizer(bad)


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path, tok):
    with pytest.raises(ValueError, match=r"vocabulary of 300 but the model's is 100"):
        check_tokenizer_fits(tok, 100)
    check_tokenizer_fits(tok, 300)
    path = tmp_path / "a.txt"
    path.write_text("some text\n")
    with pytest.raises(ValueError, match=r"300 but the model's is 299"):
        load_tokens(path, seq=2, tokenizer=tok, vocab=299)
    with pytest.raises(ValueError, match=r"bytes has a vocabulary of 256 but the model's is 200"):
        load_tokens(path, seq=2, vocab=200)


# -- tokenize once, cached ------------------------------------------------------------------------------


def test_text_with_a_tokenizer_ends_with_eos_and_is_cached(tmp_path, tok, capsys):
    text = text_of(50_000)
    path = tmp_path / "notes.txt"
    path.write_text(text)
    data = load_tokens(path, seq=32, tokenizer=tok, vocab=300)
    expected = tok.encode(text) + [tok.eos_id]
    assert isinstance(data.tokens, np.memmap) and data.tokens.dtype == np.uint16
    assert data.tokens.tolist() == expected and data.eos_id == tok.eos_id and data.vocab_size == 300
    (meta_path,) = (tmp_path / "notes.txt.pbtok").glob("*.json")
    meta = json.loads(meta_path.read_text())
    assert meta["tokens"] == len(expected) and meta["dtype"] == "uint16" and meta["max_id"] == max(expected)
    assert meta["source_size"] == path.stat().st_size and meta["documents"] == 1 and len(meta["sha256"]) == 64
    assert meta_path.with_suffix(".bin").stat().st_size == 2 * len(expected)
    x, y = data.batch(3, 4, seed=0)
    assert same((x, y), old_batch(torch.tensor(expected), 32, 3, 4))


def test_a_second_load_reads_the_cache_without_tokenizing(tmp_path, tok, monkeypatch, capsys):
    path = tmp_path / "notes.txt"
    path.write_text(text_of(20_000))
    first = load_tokens(path, seq=16, tokenizer=tok).tokens.tolist()
    capsys.readouterr()

    def refuse(*_args, **_kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(Tokenizer, "encode_batch", refuse)
    second = load_tokens(path, seq=16, tokenizer=tok)
    assert second.tokens.tolist() == first and capsys.readouterr().err == ""
    path.write_text(text_of(20_000) + "\nmore")  # new content is a new key: tokenized anew
    with pytest.raises(AssertionError, match="tokenized again"):
        load_tokens(path, seq=16, tokenizer=tok)


@pytest.mark.parametrize("damage", ["bin bytes", "bin size", "json garbage", "json missing"])
def test_a_damaged_cache_is_rebuilt_with_a_line_on_stderr(tmp_path, tok, capsys, damage):
    path = tmp_path / "notes.txt"
    path.write_text(text_of(20_000))
    good = load_tokens(path, seq=16, tokenizer=tok).tokens.tolist()
    capsys.readouterr()
    (meta_path,) = (tmp_path / "notes.txt.pbtok").glob("*.json")
    bin_path = meta_path.with_suffix(".bin")
    if damage == "bin bytes":
        raw = bytearray(bin_path.read_bytes())
        raw[10] ^= 0xFF
        bin_path.write_bytes(bytes(raw))
    elif damage == "bin size":
        bin_path.write_bytes(bin_path.read_bytes()[:-2])
    elif damage == "json garbage":
        meta_path.write_text("{")
    else:
        meta_path.unlink()
    data = load_tokens(path, seq=16, tokenizer=tok)
    err = capsys.readouterr().err
    assert data.tokens.tolist() == good
    assert err.count("\n") == 1 and "token cache" in err and "tokenizing" in err and "again" in err
    assert load_tokens(path, seq=16, tokenizer=tok).tokens.tolist() == good and capsys.readouterr().err == ""


def test_big_text_in_pieces_gives_the_whole_texts_ids(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(tokenize_module, "PIECE_BYTES", 3000)
    monkeypatch.setattr(tokenize_module, "BATCH_CHARS", 700)
    text = text_of(60_000)
    path = tmp_path / "big.txt"
    path.write_text(text)
    data = load_tokens(path, seq=16, tokenizer=tok)
    assert data.tokens.tolist() == tok.encode(text) + [tok.eos_id]


def test_pieces_never_cut_a_character(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(tokenize_module, "PIECE_BYTES", 5)  # lines longer than pieces: cut between characters
    text = "héllo wörld → ünïcödé " * 40
    path = tmp_path / "u.txt"
    path.write_text(text)
    ids = load_tokens(path, seq=4, tokenizer=tok).tokens.tolist()
    assert ids[-1] == tok.eos_id and tok.decode(ids[:-1]) == text


def test_progress_lines_on_stderr(tmp_path, tok, monkeypatch, capsys):
    monkeypatch.setattr(tokenize_module, "PROGRESS_EVERY_S", 0.0)  # every update speaks
    monkeypatch.setattr(tokenize_module, "PIECE_BYTES", 4000)
    path = tmp_path / "p.txt"
    path.write_text(text_of(20_000))
    load_tokens(path, seq=4, tokenizer=tok)
    err = capsys.readouterr().err
    assert "tokenizing" in err and " of " in err and "tokens" in err and "done" in err


def test_non_utf8_text_is_refused_with_a_tokenizer(tmp_path, tok):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"not UTF-8 text \(near byte 3\)"):
        load_tokens(path, seq=2, tokenizer=tok)
    assert load_tokens(path, seq=2).num_tokens == 13  # bytes need no decoding


def test_embedded_corpus_with_a_tokenizer(tok):
    data = load_tokens(None, seq=16, tokenizer=tok)
    assert data.tokens[-1] == tok.eos_id and data.num_tokens == len(tok.encode(default_corpus().decode())) + 1


# -- JSONL ---------------------------------------------------------------------------------------------


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_documents_are_separated_by_eos(tmp_path, tok):
    docs = [f"document {i}: def f(x): return x + {i}" for i in range(30)]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)])
    data = load_tokens(path, seq=8, tokenizer=tok)
    expected = [t for d in docs for t in tok.encode(d) + [tok.eos_id]]
    assert data.tokens.tolist() == expected and isinstance(data.tokens, np.memmap)
    (meta_path,) = (tmp_path / "d.jsonl.pbtok").glob("*.json")
    assert json.loads(meta_path.read_text())["documents"] == 30


def test_jsonl_other_field_and_its_errors(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": "alpha beta"}, {"body": "gamma"}])
    data = load_tokens(path, seq=2, tokenizer=tok, field="body")
    assert data.tokens.tolist() == tok.encode("alpha beta") + [tok.eos_id] + tok.encode("gamma") + [tok.eos_id]
    # blank lines count: the second record is on line 3
    with pytest.raises(ValueError, match=r"line 1 of .* has no field 'text' \(it has 'body'\): --data-field"):
        load_tokens(path, seq=2, tokenizer=tok)
    missing = write_jsonl(tmp_path / "m.jsonl", [{"text": "a"}, {"body": "b"}])
    with pytest.raises(ValueError, match=r"line 3 of .* has no field 'text'.*--data-field"):
        load_tokens(missing, seq=2, tokenizer=tok)
    broken = write_jsonl(tmp_path / "b.jsonl", [{"text": "a"}, '{"text": "b"'])
    with pytest.raises(ValueError, match=r"line 3 of .* is not JSON"):
        load_tokens(broken, seq=2, tokenizer=tok)
    numbers = write_jsonl(tmp_path / "n.jsonl", [{"text": 5}])
    with pytest.raises(ValueError, match=r"line 1 .*field 'text' is a int, not text"):
        load_tokens(numbers, seq=2, tokenizer=tok)


def test_jsonl_without_a_tokenizer_is_its_bytes(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "abc"}, {"text": "dé"}])
    data = load_tokens(path, seq=2)
    assert data.tokens.tolist() == list(b"abc") + list("dé".encode()) and data.eos_id is None


def test_empty_inputs_are_refused(tmp_path, tok):
    for name in ("e.txt", "e.jsonl", "e.bin"):
        (tmp_path / name).write_bytes(b"")
        with pytest.raises(ValueError, match="is empty"):
            load_tokens(tmp_path / name, seq=2, tokenizer=tok if name != "e.bin" else None)
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no JSON lines"):
        load_tokens(tmp_path / "blank.jsonl", seq=2, tokenizer=tok)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match=r"not a file and holds no \.bin token shards"):
        load_tokens(tmp_path / "empty_dir", seq=2)


# -- token files ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_is_mapped_and_batches_as_the_array_would(tmp_path, dtype):
    rng = np.random.default_rng(0)
    high = 300 if dtype == "uint16" else 100_000
    ids = rng.integers(0, high, size=5000)
    path = write_tokens(tmp_path / "train.bin", ids, dtype)
    data = load_tokens(path, seq=32, dtype=dtype, vocab=high)
    assert isinstance(data.tokens, np.memmap) and data.tokens.dtype == np.dtype(dtype)
    assert data.num_tokens == 5000 and data.vocab_size == high
    assert same(data.batch(4, 16, seed=2), old_batch(torch.from_numpy(ids), 32, 4, 16, seed=2))
    train, held = data.split(0.2)
    assert isinstance(train.tokens, np.memmap) and isinstance(held.tokens, np.memmap)
    assert train.num_tokens == 4000 and np.shares_memory(train.tokens, data.tokens)


def test_a_directory_of_shards_reads_as_their_concatenation(tmp_path):
    parts = [np.arange(0, 40), np.arange(40, 47), np.arange(47, 100)]
    folder = tmp_path / "shards"
    folder.mkdir()
    for name, part in zip(("b.bin", "a.bin", "c.bin"), (parts[1], parts[0], parts[2])):
        write_tokens(folder / name, part, "uint16")
    (folder / "README.txt").write_text("not a shard")
    data = load_tokens(folder, seq=9, vocab=100)
    assert isinstance(data.tokens, ShardedTokens) and all(isinstance(p, np.memmap) for p in data.tokens.parts)
    whole = torch.arange(100)  # a.bin, b.bin, c.bin in name order
    every = data.eval_batch(data.num_windows)  # every window, those across shard boundaries too
    assert same(every, old_batch_all(whole, 9))
    assert same(data.batch(1, 8, seed=5), old_batch(whole, 9, 1, 8, seed=5))
    train, held = data.split(0.5)
    assert train.num_tokens == 50 and isinstance(held.tokens, np.memmap) and held.tokens[0] == 50
    assert isinstance(train.tokens, ShardedTokens) and train.tokens[np.array([39, 40, 49])].tolist() == [39, 40, 49]


def old_batch_all(tokens: torch.Tensor, seq: int):
    windows = tokens[torch.arange(tokens.numel() - seq)[:, None] + torch.arange(seq + 1)]
    return windows[:, :-1], windows[:, 1:]


def test_token_file_of_odd_size_or_unknown_dtype_is_refused(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\1\0\2\0\3\0\4")
    with pytest.raises(ValueError, match=r"7 bytes, not a whole number of uint16 ids.*--data-dtype uint32.*damaged"):
        load_tokens(path, seq=2)
    path.write_bytes(b"\1\0\2\0\3\0")
    with pytest.raises(ValueError, match=r"6 bytes, not a whole number of uint32 ids.*--data-dtype uint16"):
        load_tokens(path, seq=2, dtype="uint32")
    with pytest.raises(ValueError, match=r"--data-dtype 'int64': give uint16 or uint32"):
        load_tokens(path, seq=2, dtype="int64")


def test_an_id_beyond_the_vocabulary_names_the_id_the_vocabulary_and_the_file(tmp_path):
    ids = np.arange(1000) % 300
    ids[777] = 70_000
    path = write_tokens(tmp_path / "t.bin", ids, "uint32")
    with pytest.raises(ValueError, match=r"token id 70000 at token 777 of .*t\.bin is beyond the model's vocabulary "
                                         r"of 32000: tokenize with the model's tokenizer.*--data-dtype uint16"):
        load_tokens(path, seq=8, dtype="uint32", vocab=32000)
    small = write_tokens(tmp_path / "s.bin", [1, 2, 400, 3], "uint16")
    with pytest.raises(ValueError, match=r"token id 400 at token 2 .* vocabulary of 320"):
        load_tokens(small, seq=2, vocab=320)
    assert load_tokens(small, seq=2).vocab_size == 401  # no vocabulary given: the largest id says


def test_the_vocabulary_scan_goes_a_chunk_at_a_time_across_shards(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    write_tokens(folder / "0.bin", [1, 2, 3, 4, 5], "uint16")
    write_tokens(folder / "1.bin", [6, 7, 900, 8], "uint16")
    shards = token_shards(folder, "uint16")
    shard, at, token = first_token_at_least(shards, 500, chunk=2)
    assert (shard.path.name, at, token) == ("1.bin", 2, 900)
    assert first_token_at_least(shards, 901, chunk=3) is None


def test_a_tokenized_cache_records_its_largest_id_for_the_vocabulary_check(tmp_path, tok, monkeypatch):
    path = tmp_path / "notes.txt"
    path.write_text(text_of(5000))
    data = load_tokens(path, seq=8, tokenizer=tok, vocab=300)
    (meta_path,) = (tmp_path / "notes.txt.pbtok").glob("*.json")
    meta = json.loads(meta_path.read_text())
    assert meta["max_id"] == int(np.max(data.tokens))
    small = Tokenizer(tok.name, 250, tok.eos_id, tok.identity, tok.backend)  # its cache, a smaller claimed vocabulary
    with pytest.raises(ValueError, match=rf"token id {meta['max_id']} in .*notes\.txt is beyond .* vocabulary of 250"):
        load_tokens(path, seq=8, tokenizer=small, vocab=250)


# -- the held-out cut --------------------------------------------------------------------------------------


def test_held_out_cut_lands_right_after_an_eos(tmp_path, tok):
    eos = tok.eos_id  # a token file's documents end with the EOS of the tokenizer given with it
    docs = [np.full(length, 7 + i) for i, length in enumerate((30, 25, 20, 14))]
    ids = np.concatenate([np.append(d, eos) for d in docs])  # EOS after tokens 30, 56, 77, 92
    path = write_tokens(tmp_path / "docs.bin", ids, "uint16")
    data = load_tokens(path, seq=4, tokenizer=tok)
    assert data.eos_id == eos and data.vocab_size == 300
    assert len(ids) == 93
    train, held = data.split(0.2)  # nominal cut at 93 - 19 = 74: back to just after the EOS at 56
    assert train.num_tokens == 57 and train.tokens[-1] == eos and held.tokens[0] == 9
    assert isinstance(train.tokens, np.memmap) and isinstance(held.tokens, np.memmap)
    train, held = data.split(0.05)  # nominal 88; its reach (5 back) holds no EOS: the token cut
    assert train.num_tokens == 88
    no_eos = load_tokens(path, seq=4)  # without a tokenizer's EOS: the token cut, as always
    assert no_eos.split(0.2)[0].num_tokens == 74


def test_held_out_cut_on_tokenized_jsonl_keeps_documents_whole(tmp_path, tok):
    docs = [f"record {i} " + "word " * (i % 7 + 3) for i in range(60)]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    data = load_tokens(path, seq=8, tokenizer=tok)
    train, held = data.split(0.1)
    assert train.tokens[-1] == tok.eos_id and train.num_tokens <= data.num_tokens - round(data.num_tokens * 0.1)
    assert tok.decode(held.tokens).startswith("record ")


# -- saved datasets -----------------------------------------------------------------------------------------


def test_a_saved_dataset_is_tokenized_once_beside_it(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    import pyarrow

    table = pyarrow.table({"text": ["first doc", "second one"], "body": ["alt a", "alt b"]})
    # a fixed fingerprint: saving needs no hashing of the table
    datasets.Dataset(datasets.table.InMemoryTable(table), fingerprint="0" * 16).save_to_disk(str(tmp_path / "ds"))
    data = load_tokens(tmp_path / "ds", seq=2, tokenizer=tok)
    eos = [tok.eos_id]
    assert data.tokens.tolist() == tok.encode("first doc") + eos + tok.encode("second one") + eos
    assert isinstance(data.tokens, np.memmap) and list((tmp_path / "ds.pbtok").glob("*.bin"))
    body = load_tokens(tmp_path / "ds", seq=2, tokenizer=tok, field="body")
    assert body.tokens.tolist() == tok.encode("alt a") + eos + tok.encode("alt b") + eos
    with pytest.raises(ValueError, match=r"no field 'words' \(it has text, body\): --data-field"):
        load_tokens(tmp_path / "ds", seq=2, tokenizer=tok, field="words")


def test_a_saved_dataset_without_the_datasets_library_says_how_to_install_it(tmp_path, tok, monkeypatch):
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "dataset_info.json").write_text("{}")
    (folder / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match=r"saved Hugging Face dataset.*pip install datasets"):
        load_tokens(folder, seq=2, tokenizer=tok)
