"""The reference GPT and its stage split: stages compose to exactly the whole model."""
from __future__ import annotations

import pytest
import torch

from pipeblocks.core import Placement
from pipeblocks.models import GPT, GPTConfig, build_stages, causal_attention, cross_entropy, layer_counts, split_stages

pytestmark = pytest.mark.torch

CFG = GPTConfig(layers=6, hidden=32, heads=4, seq=16, vocab=64, dtype="float64")


def _tokens(b: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (b, CFG.seq), generator=torch.Generator().manual_seed(seed))


def _run(stages, x):
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize(
    "placement",
    [Placement.loop(1), Placement.loop(3), Placement.loop(2, 2), Placement.loop(2, 3), Placement.v_shape(2),
     Placement.v_shape(3)],
    ids=lambda pl: f"{pl.shape}-{','.join(map(str, pl.stage_to_rank))}",
)
def test_stages_built_per_rank_compose_to_the_full_model(placement):
    full = GPT(CFG, seed=7)
    S = placement.num_stages
    by_stage = {}
    for rank in range(placement.num_ranks):
        mine = build_stages(CFG, seed=7, num_stages=S, stages=placement.stages_of(rank))
        by_stage.update({st.index: st for st in mine})
    stages = [by_stage[s] for s in range(S)]
    x, y = _tokens(), _tokens(seed=2)

    logits_full = full(x)
    logits = _run(stages, x)
    assert logits.shape == (3, CFG.seq, CFG.vocab)
    assert torch.equal(logits, logits_full)

    cross_entropy(logits_full, y).backward()
    cross_entropy(logits, y).backward()
    grads_full = {n: p.grad for n, p in full.named_parameters()}
    grads = {n: p.grad for st in stages for n, p in st.named_parameters()}
    assert grads.keys() == grads_full.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, grads_full[name]), name


def test_split_shares_parameters_and_names_with_the_model():
    full = GPT(CFG, seed=0)
    stages = split_stages(full.config, full, 4)
    params = {id(p) for st in stages for p in st.parameters()}
    assert params == {id(p) for p in full.parameters()}
    merged = {k: v for st in stages for k, v in st.state_dict().items()}
    assert merged.keys() == full.state_dict().keys()
    assert stages[0].embed is full.embed and stages[-1].head is full.head
    assert stages[0].is_first and stages[-1].is_last and not stages[1].is_first


def test_float32_and_float64_models_from_one_seed_agree_to_float32_rounding():
    a = GPT(CFG, seed=3)
    b = GPT(GPTConfig(**{**CFG.to_json(), "dtype": "float32"}), seed=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and pb.dtype == torch.float32
        assert torch.equal(pa.to(torch.float32), pb)
    assert not torch.equal(GPT(CFG, seed=4).blocks[0].mlp.up.weight, a.blocks[0].mlp.up.weight)


def test_untrained_loss_is_near_log_vocab():
    loss = cross_entropy(GPT(CFG, seed=0)(_tokens()), _tokens(seed=5))
    assert abs(loss.item() - torch.log(torch.tensor(float(CFG.vocab))).item()) < 0.05


@pytest.mark.parametrize(
    "layers, stages, expected",
    [(4, 4, (1, 1, 1, 1)), (8, 4, (2, 2, 2, 2)), (10, 4, (2, 3, 3, 2)), (9, 4, (2, 3, 2, 2)),
     (7, 4, (2, 2, 2, 1)), (5, 2, (3, 2)), (3, 1, (3,)), (13, 6, (2, 3, 2, 2, 2, 2))],
)
def test_layer_balancing(layers, stages, expected):
    counts = layer_counts(layers, stages)
    assert counts == expected
    assert sum(counts) == layers and max(counts) - min(counts) <= 1


def test_fewer_layers_than_stages_is_a_clear_error():
    with pytest.raises(ValueError, match=r"3 transformer layers but the pipeline has 4 stages.*--layers 4"):
        layer_counts(3, 4)
    with pytest.raises(ValueError, match="4 stages"):
        small = GPTConfig(layers=3, hidden=16, heads=2, seq=8, vocab=16)
        split_stages(small, GPT(small), 4)


def test_explicit_layer_counts_are_checked():
    full = GPT(CFG)
    assert [len(s.block_indices) for s in split_stages(full.config, full, 2, counts=(1, 5))] == [1, 5]
    with pytest.raises(ValueError, match="summing to 6"):
        split_stages(full.config, full, 2, counts=(2, 2))


@pytest.mark.parametrize(
    "kwargs, message",
    [({"hidden": 30, "heads": 4}, "multiple of heads"), ({"layers": 0}, "layers must be"),
     ({"dtype": "float16"}, "dtype must be one of")],
)
def test_bad_config_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_causal_attention_over_a_longer_prefix_is_bottom_right_aligned():
    # The last chunk's queries attending over all keys must equal the last rows of full attention.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 8, generator=g, dtype=torch.float64) for _ in range(3))
    full = causal_attention(q, k, v)
    tail = causal_attention(q[:, :, 8:], k, v)
    torch.testing.assert_close(tail, full[:, :, 8:], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="keys must include"):
        causal_attention(q, k[:, :, :4], v[:, :, :4])


def test_position_offset_beyond_context_is_an_error():
    with pytest.raises(ValueError, match="exceed the model's context of 16"):
        GPT(CFG).embed(_tokens()[:, :4], offset=14)
