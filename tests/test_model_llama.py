"""The built-in Llama: its config, its parts, and sequence chunks (Seq1F1B) for both built-in
models: chunks run through the runtime's K/V cache, backward LIFO over chunks, give the
whole sequence's loss and gradients."""
from __future__ import annotations

import pytest
import torch

from pipeblocks.models import LlamaConfig, build_stages, get_family
from pipeblocks.models.llama import Llama, LlamaBlock, apply_rotary
from pipeblocks.runtime.sequence import KVCache, SequenceChunk, chunk_bounds

pytestmark = pytest.mark.torch

CFG = LlamaConfig(layers=2, hidden=16, heads=4, kv_heads=2, seq=12, vocab=19, dtype="float64")


def test_config_round_trips_and_fills_its_defaults():
    cfg = LlamaConfig(layers=3, hidden=48, heads=6, kv_heads=3, seq=32, vocab=100, dtype="float64", rope_theta=500.0)
    assert LlamaConfig.from_json(cfg.to_json()) == cfg
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.intermediate_size) == (8, 3, 128)
    assert LlamaConfig().num_kv_heads == LlamaConfig().heads
    assert LlamaConfig(hidden=64, intermediate=100).intermediate_size == 100


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hidden": 30, "heads": 4}, r"hidden \(30\) must be a multiple of heads \(4\): change --hidden to e.g. 32"),
        ({"hidden": 12, "heads": 4}, r"hidden / heads = 12 / 4 = 3 must be even .*--hidden to e.g. 16"),
        ({"heads": 4, "kv_heads": 3}, r"kv_heads \(3\) must divide heads \(4\).*--kv-heads 1 or 2 or 4"),
        ({"layers": 0}, r"LlamaConfig.layers must be an integer >= 1, got 0"),
        ({"kv_heads": 0}, r"LlamaConfig.kv_heads must be an integer >= 1"),
        ({"dtype": "bfloat16"}, "dtype must be one of"),
        ({"rope_theta": 0.0}, r"rope_theta must be a finite number > 0"),
    ],
)
def test_bad_config_is_rejected_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**kwargs)


def test_grouped_query_attention_shares_kv_heads():
    block = LlamaBlock(CFG)
    assert block.attn.k_proj.weight.shape == (CFG.num_kv_heads * CFG.head_dim, CFG.hidden)
    assert block.attn.q_proj.weight.shape == (CFG.hidden, CFG.hidden)


def test_rotary_keeps_norms_and_depends_on_relative_position():
    model = Llama(CFG, seed=0)
    cos, sin = model.rotary(0, CFG.seq, torch.float64)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, CFG.seq, CFG.head_dim, generator=g, dtype=torch.float64) for _ in range(2))
    rq = apply_rotary(q, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1), rtol=1e-12, atol=1e-12)
    same = q[..., :1, :].expand_as(q), k[..., :1, :].expand_as(k)  # one query and one key at every position
    scores = apply_rotary(same[0], cos, sin)[0, 0, 3:] @ apply_rotary(same[1], cos, sin)[0, 0, :-3].T
    torch.testing.assert_close(scores.diagonal(), scores.diagonal()[:1].expand(CFG.seq - 3), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="positions 10..13 exceed the model's context of 12"):
        model.rotary(10, 4, torch.float64)


def test_untrained_loss_is_near_log_vocab():
    spec = get_family("llama").spec(CFG)
    tokens = torch.randint(0, CFG.vocab, (4, CFG.seq + 1), generator=torch.Generator().manual_seed(1))
    loss = spec.loss(Llama(CFG, seed=0)(tokens[:, :-1]), tokens[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(float(CFG.vocab))).item()) < 0.05


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("lengths", [(7, 5), (4, 3, 5)], ids=["k2", "k3"])
def test_sequence_chunks_equal_the_whole_sequence(name, lengths):
    fields = dict(layers=2, hidden=16, heads=4, seq=12, vocab=19, dtype="float64")
    cfg = get_family(name).config(**fields, kv_heads=2 if name == "llama" else None)
    family = get_family(name).spec(cfg)
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq + 1), generator=torch.Generator().manual_seed(3))
    x, y = tokens[:, :-1], tokens[:, 1:]
    whole = build_stages(family, seed=0, num_stages=2, stages=(0, 1))
    want = family.loss(whole[1](whole[0](x)), y)
    want.backward()

    stages = build_stages(family, seed=0, num_stages=2, stages=(0, 1))
    assert all(s.supports_sequence_chunks for s in stages)
    cache, losses = KVCache(), []
    k = len(lengths)
    for c, (offset, n) in enumerate(chunk_bounds(list(lengths))):
        h = x[:, offset:offset + n]
        for s, stage in enumerate(stages):
            h = stage(h, chunk=SequenceChunk(s, 0, c, k, offset, n, cfg.seq, cache))
        losses.append(family.loss(h, y[:, offset:offset + n]) * n / cfg.seq)  # mean over the whole sequence
    for loss in reversed(losses):  # backward LIFO over chunks, as the schedules run it
        loss.backward()
    assert sum(loss.item() for loss in losses) == pytest.approx(want.item(), rel=1e-12)
    got = {n: p.grad for s in stages for n, p in s.named_parameters()}
    for (name_, p) in ((n, p) for s in whole for n, p in s.named_parameters()):
        err = (got[name_] - p.grad).abs().max().item() / p.grad.abs().max().item()
        assert err <= 1e-10, f"{name_}: relative error {err:.3g}"
