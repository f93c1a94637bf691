"""Byte tokenizer and token windows: round trips, determinism by (seed, step), clear errors."""
from __future__ import annotations

import pytest
import torch

from pipeblocks.data import ByteTokenizer, TokenWindows, default_corpus

pytestmark = pytest.mark.torch


def test_byte_tokenizer_round_trips_unicode():
    text = "héllo, wörld → ok"
    ids = ByteTokenizer.encode(text)
    assert ids.dtype == torch.long and ids.numel() == len(text.encode()) and int(ids.max()) < 256
    assert ByteTokenizer.decode(ids) == text


def test_default_corpus_ships_with_python_and_is_large_enough():
    data = TokenWindows.load(None, seq=256)
    assert data.source == "pydoc_data.topics"
    assert data.tokens.numel() == len(default_corpus()) > 100_000
    assert isinstance(default_corpus(), bytes)
    assert "for" in ByteTokenizer.decode(data.tokens[:20_000])


def test_windows_are_shifted_targets_of_consecutive_tokens(tmp_path):
    path = tmp_path / "abc.txt"
    path.write_text("abcdefghijklmnopqrstuvwxyz")
    data = TokenWindows.load(path, seq=5)
    x, y = data.batch(step=3, batch_size=7, seed=1)
    assert x.shape == y.shape == (7, 5) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y - x, torch.ones_like(x))  # the alphabet: each target is the next letter
    assert int(x.min()) >= ord("a") and int(y.max()) <= ord("z")


def test_batches_depend_only_on_seed_and_step():
    data = TokenWindows.load(None, seq=32)
    a = data.batch(step=5, batch_size=4, seed=0)
    data.batch(step=0, batch_size=4, seed=0)  # drawing other batches first changes nothing
    b = TokenWindows.load(None, seq=32).batch(step=5, batch_size=4, seed=0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], data.batch(step=6, batch_size=4, seed=0)[0])
    assert not torch.equal(a[0], data.batch(step=5, batch_size=4, seed=1)[0])


def test_shortest_possible_text_gives_its_only_window(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("abcd")
    x, y = TokenWindows.load(path, seq=3).batch(step=0, batch_size=2)
    assert ByteTokenizer.decode(x[0]) == "abc" and ByteTokenizer.decode(y[1]) == "bcd"


def test_bad_data_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        TokenWindows.load(tmp_path / "missing.txt", seq=8)
    with pytest.raises(ValueError, match="not a file"):
        TokenWindows.load(tmp_path, seq=8)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        TokenWindows.load(empty, seq=8)
    short = tmp_path / "short.txt"
    short.write_text("0123456789")
    with pytest.raises(ValueError, match=r"has 10 tokens but a sequence of 64 needs at least 65.*--seq 9"):
        TokenWindows.load(short, seq=64)
