"""Hugging Face's LlamaForCausalLM through the splitter: the stages compute what HF's own
forward computes (SDPA and eager attention), weights are fixed by the seed, and the stages
refuse sequence chunks. The adapter's tuple handling needs no transformers."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeblocks.models import LlamaConfig, Stage, build_stages, split_stages
from pipeblocks.models.hf.adapter import HF_LAYOUT, HFDecoderAdapter

pytestmark = pytest.mark.torch

CFG = LlamaConfig(layers=3, hidden=16, heads=4, kv_heads=2, seq=8, vocab=32, dtype="float64")


def _tokens() -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (2, CFG.seq), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_stages_give_hf_forward_logits(attn):
    pytest.importorskip("transformers", reason="hf-llama needs transformers (pip install -e .[hf])")
    from pipeblocks.models.hf_llama import build_hf_llama, hf_llama_spec

    model = build_hf_llama(CFG, seed=2, attn_implementation=attn)
    spec = hf_llama_spec(CFG, attn_implementation=attn)
    assert model.config.num_key_value_heads == 2 and not model.config.tie_word_embeddings
    x = _tokens()
    want = model(x).logits  # HF's own forward: create_causal_mask, its rotary, its layer loop
    for stages in (split_stages(spec, model, 2), build_stages(spec, seed=2, num_stages=3, stages=(0, 1, 2))):
        h = x
        for stage in stages:
            h = stage(h)
        torch.testing.assert_close(h, want, rtol=1e-12, atol=1e-12)


def test_weights_are_fixed_by_the_seed_and_stages_refuse_chunks():
    pytest.importorskip("transformers", reason="hf-llama needs transformers (pip install -e .[hf])")
    from pipeblocks.models.hf_llama import build_hf_llama, hf_llama_spec

    a, b = build_hf_llama(CFG, seed=0), build_hf_llama(CFG, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, build_hf_llama(CFG, seed=1).lm_head.weight)
    assert a.model.layers[0].input_layernorm.weight.eq(1).all()
    stage = split_stages(hf_llama_spec(CFG), a, 1)[0]
    assert "model.layers.2.self_attn.q_proj.weight" in dict(stage.named_parameters())

    class Chunk:
        offset = 0

    with pytest.raises(ValueError, match="cannot run sequence chunks: its adapter HFDecoderAdapter"):
        stage(_tokens(), chunk=Chunk())


class _Rotary(nn.Module):
    def forward(self, h, position_ids):
        angles = position_ids[..., None].to(h.dtype).expand(*position_ids.shape, 2)
        return angles.cos(), angles.sin()


class _TupleLayer(nn.Module):
    """A decoder layer as transformers 4.x returns it: (hidden, ...)."""

    def forward(self, h, attention_mask=None, position_ids=None, position_embeddings=None):
        assert position_ids.tolist() == [list(range(h.size(1)))]
        return (h + 1, None)


class _TensorLayer(_TupleLayer):
    def forward(self, h, **kwargs):
        return super().forward(h, **kwargs)[0] * 2


def test_adapter_takes_a_tuple_or_a_tensor_from_a_layer():
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Identity()
    model.model.layers = nn.ModuleList([_TupleLayer(), _TensorLayer()])
    model.model.norm = nn.Identity()
    model.model.rotary_emb = _Rotary()
    model.lm_head = nn.Identity()
    from pipeblocks.models.splitter import split_model

    for attn in ("sdpa", "eager"):
        (stage,) = split_model(model, HF_LAYOUT, 1, adapter=HFDecoderAdapter(attn))
        assert isinstance(stage, Stage)
        out = stage(torch.zeros(1, 3, 2))
        assert out.eq(4).all()  # (0 + 1) then (1 + 1) * 2
