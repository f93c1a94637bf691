"""Attention memory and the Seq1F1B K/V buffer, in one process (fast).

* The reference GPT's attention (torch's scaled_dot_product_attention) saves bytes linear
  in the sequence, in float32 and float64: no s x s probabilities are kept for backward.
* Through the runtime's K/V cache, chunks of a sequence attend over one K/V buffer per
  microbatch and layer: a chunk's saved bytes do not grow with the keys it attends over
  (no copied prefix, no [queries, keys] mask), and the buffer is counted once, on chunk 0.
* Forward in chunk order and backward LIFO over chunks (fused, or B now and W later as the
  split schedules run it) give the gradients of the whole sequence to 1e-10 in float64.
"""
from __future__ import annotations

import pytest
import torch

from pipeblocks.models import GPTConfig, cross_entropy, split_stages
from pipeblocks.models.gpt import GPT, CausalSelfAttention
from pipeblocks.runtime.compute import ModuleCompute
from pipeblocks.runtime.memory import SavedTensorTracker
from pipeblocks.runtime.sequence import (
    KVCache,
    SequenceChunk,
    chunk_bounds,
    reversed_causal_mask,
)

pytestmark = pytest.mark.torch


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor, **kwargs) -> int:
    tracker = SavedTensorTracker()
    tracker.exclude(list(module.parameters()))
    with tracker.saving():
        out = module(x, **kwargs)
    del out
    return tracker.peak


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_attention_saves_bytes_linear_in_the_sequence(dtype):
    cfg = GPTConfig(layers=1, hidden=16, heads=4, seq=512, vocab=11, dtype=dtype)
    attn = CausalSelfAttention(cfg)
    sizes = {}
    for s in (256, 512):
        x = torch.randn(2, s, cfg.hidden, dtype=cfg.torch_dtype, requires_grad=True)
        sizes[s] = _saved_bytes(attn, x)
    probabilities = 2 * cfg.heads * 256 * 256 * cfg.torch_dtype.itemsize  # what storing them would cost at 256
    assert sizes[256] < probabilities / 4
    assert sizes[512] == pytest.approx(2 * sizes[256], rel=0.01)  # s x s storage would make it ~4x


def test_reversed_mask_is_bottom_right_causal():
    for s_q, s_k in ((3, 3), (2, 5), (4, 9)):
        mask = reversed_causal_mask(s_q, s_k, torch.float64, torch.device("cpu"))
        visible = torch.ones(s_q, s_k, dtype=torch.bool).tril(diagonal=s_k - s_q)  # keys in position order
        assert torch.equal(mask.flip(-1) == 0, visible)
        assert mask.untyped_storage().nbytes() == (s_q + s_k - 1) * 8  # one row, not s_q x s_k


class _Attend(torch.nn.Module):
    """One attention layer called with a sequence chunk, as GPTStage calls its blocks."""

    def __init__(self, attn: CausalSelfAttention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x, chunk):
        return self.attn(x, chunk.kv("attn"))


def test_chunks_share_one_kv_buffer():
    cfg = GPTConfig(layers=1, hidden=16, heads=4, seq=256, vocab=11, dtype="float64")
    attn = _Attend(CausalSelfAttention(cfg))
    cache = KVCache()
    x = torch.randn(2, 256, cfg.hidden, dtype=torch.float64)
    tracker = SavedTensorTracker()
    tracker.exclude(list(attn.parameters()))
    held, outs = [], []
    for c, (offset, n) in enumerate(chunk_bounds([64] * 4)):
        before = tracker.current
        with tracker.saving():
            chunk = SequenceChunk(0, 0, c, 4, offset, n, 256, cache)
            outs.append(attn(x[:, offset:offset + n].clone().requires_grad_(), chunk=chunk))
        held.append(tracker.current - before)
    buffer = 2 * 2 * 256 * cfg.hidden * 8  # K and V of the whole sequence, float64
    mask_rows = [8 * (64 + 64 * (c + 1) - 1) for c in range(4)]
    own = [h - m for h, m in zip(held, mask_rows)]
    assert own[0] - own[1] == buffer  # chunk 0 allocates the buffer; the rest is per chunk
    assert own[1] == own[2] == own[3]  # no chunk keeps a copy of the earlier chunks' K/V
    cache.take_used()
    del outs
    cache.release(0, 0)
    assert tracker.current == 0 and len(cache) == 0


def _reference(cfg: GPTConfig, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model = GPT(cfg, seed=0)
    cross_entropy(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("split", [False, True], ids=["fused", "b-then-w"])
@pytest.mark.parametrize("lengths", [(24,), (7, 6, 6, 5), (13, 11)], ids=["k1", "k4", "k2"])
def test_chunked_stages_match_the_whole_sequence(split, lengths):
    cfg = GPTConfig(layers=2, hidden=16, heads=2, seq=24, vocab=11, dtype="float64")
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    want = _reference(cfg, x, y)
    stages = split_stages(cfg, GPT(cfg, seed=0), 2)
    tracker = SavedTensorTracker(enabled=False)
    computes = [ModuleCompute({s: stage}, cross_entropy, 1, 1, tracker) for s, stage in enumerate(stages)]
    k, units = len(lengths), []
    for c, (offset, n) in enumerate(chunk_bounds(list(lengths))):
        h = x[:, offset:offset + n]
        chain = []
        for s in range(2):
            chunk = SequenceChunk(s, 0, c, k, offset, n, cfg.seq)
            h, unit = computes[s].forward(s, h, y[:, offset:offset + n] if s == 1 else None, chunk=chunk)
            chain.append(unit)
        units.append(chain)
    deferred = []
    for chain in reversed(units):  # LIFO over chunks
        grad = None
        for s in (1, 0):
            if split:
                grad = computes[s].input_grad(s, chain[s], grad)
                deferred.append((s, chain[s]))
            else:
                grad = computes[s].full_backward(s, chain[s], grad)
    for s, unit in deferred:  # every W after every B, as a schedule may order them
        computes[s].weight_grad(s, unit)
    got = {n: p.grad for stage in stages for n, p in stage.named_parameters()}
    assert got.keys() == want.keys()
    for name, grad in want.items():
        err = (got[name] - grad).abs().max().item() / grad.abs().max().item()
        assert err <= 1e-10, f"{name}: relative error {err:.3g}"
    assert all(len(c.kv_cache) == 0 for c in computes)
