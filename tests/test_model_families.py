"""The three built-in families through their specs (`models.build`): stages built per rank
(loop and V placements) and stages sharing the model's parameters give exactly the unsplit
model's loss and gradients in float64; no stage tensor is left uninitialised."""
from __future__ import annotations

import ast
import importlib.util
import math
from pathlib import Path

import pytest
import torch

import pipeblocks
from pipeblocks.core import Placement
from pipeblocks.models import GPTConfig, LlamaConfig, build_model, build_stages, family_names, get_family, model_logits
from pipeblocks.models import split_stages

pytestmark = pytest.mark.torch

FIELDS = dict(layers=4, hidden=16, heads=4, kv_heads=2, seq=8, vocab=32, dtype="float64")
HF = pytest.param("hf-llama", marks=pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                                       reason="hf-llama needs transformers (pip install -e .[hf])"))
FAMILIES = ["gpt", "llama", HF]


def _config(name: str):
    fields = dict(FIELDS, kv_heads=None) if name == "gpt" else FIELDS
    return get_family(name).config(**fields)


def _batch(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq + 1), generator=torch.Generator().manual_seed(2))
    return tokens[:, :-1], tokens[:, 1:]


def _assert_exact(spec, full, stages, cfg) -> None:
    x, y = _batch(cfg)
    h = x
    for stage in stages:
        h = stage(h)
    loss, want = spec.loss(h, y), spec.loss(model_logits(full(x)), y)
    assert math.isclose(loss.item(), want.item(), rel_tol=1e-10)
    loss.backward()
    want.backward()
    got = {n: p.grad for s in stages for n, p in s.named_parameters()}
    assert got.keys() == dict(full.named_parameters()).keys()
    for name, p in full.named_parameters():
        err = (got[name] - p.grad).abs().max().item() / p.grad.abs().max().item()
        assert err <= 1e-10, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("placement", [Placement.loop(2, 2), Placement.v_shape(2)], ids=["loop-2x2", "v-2"])
@pytest.mark.parametrize("name", FAMILIES)
def test_stages_built_per_rank_equal_the_unsplit_model(name, placement):
    spec, cfg = get_family(name).spec(_config(name)), _config(name)
    full = build_model(spec, seed=3)
    S = placement.num_stages
    by_stage = {}
    for rank in range(placement.num_ranks):
        mine = build_stages(spec, seed=3, num_stages=S, stages=placement.stages_of(rank), device="cpu")
        by_stage.update({s.index: s for s in mine})
    stages = [by_stage[s] for s in range(S)]
    assert [s.block_indices for s in stages] == [range(i, i + 1) for i in range(4)]
    params, buffers = dict(full.named_parameters()), dict(full.named_buffers())
    for stage in stages:  # every tensor holds the model's values: none is to_empty's garbage
        for n, p in stage.named_parameters():
            assert torch.equal(p, params[n]), n
        for n, b in stage.named_buffers():
            assert torch.equal(b, buffers[n]), n
    _assert_exact(spec, full, stages, cfg)


@pytest.mark.parametrize("name", FAMILIES)
def test_split_shares_the_models_parameters(name):
    family, cfg = get_family(name), _config(name)
    spec = family.spec(cfg)
    full = build_model(spec, seed=1)
    stages = split_stages(spec, full, 3)
    assert [len(s.block_indices) for s in stages] == [1, 2, 1]
    assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in full.parameters()}
    assert {k for s in stages for k in s.state_dict()} == full.state_dict().keys()
    assert all(s.supports_sequence_chunks == family.supports_sequence_chunks for s in stages)
    _assert_exact(spec, full, stages, cfg)


def test_registry_names_configs_and_descriptions():
    assert family_names() == ("gpt", "llama", "hf-llama")
    gpt, llama = get_family("gpt"), get_family("llama")
    assert gpt.supports_sequence_chunks and llama.supports_sequence_chunks
    cfg = gpt.config(layers=8, hidden=64, heads=4, seq=64, vocab=256)
    assert cfg == GPTConfig(layers=8, hidden=64, heads=4, seq=64, vocab=256)
    assert gpt.spec(cfg).describe() == "8-layer GPT (hidden 64, 4 heads)"
    lcfg = llama.config(layers=8, hidden=64, heads=4, kv_heads=2, seq=64, vocab=256, dtype="float32")
    assert isinstance(lcfg, LlamaConfig) and lcfg.num_kv_heads == 2
    assert llama.spec(lcfg).describe() == "8-layer Llama (hidden 64, 4 heads, 2 KV heads)"
    assert llama.spec(llama.config(layers=2, hidden=8, heads=2, seq=4, vocab=8)).describe() == \
        "2-layer Llama (hidden 8, 2 heads)"
    with pytest.raises(ValueError, match="unknown model family 'mamba': choose one of gpt, llama, hf-llama"):
        get_family("mamba")
    with pytest.raises(ValueError, match="--kv-heads 2 applies to the llama and hf-llama families.*drop --kv-heads"):
        gpt.config(layers=8, hidden=64, heads=4, kv_heads=2, seq=64, vocab=256)
    with pytest.raises(TypeError, match=r"the llama family takes a LlamaConfig, got GPTConfig.*get_family\('llama'\)"):
        llama.spec(cfg)


def test_hf_llama_without_transformers_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a))
    message = r"^--model-family hf-llama needs transformers: pip install -e \.\[hf\] \(or pip install transformers\)$"
    with pytest.raises(ValueError, match=message):
        get_family("hf-llama")
    from pipeblocks.models.family import FAMILIES

    family = FAMILIES["hf-llama"]
    cfg = family.config(layers=2, hidden=8, heads=2, seq=4, vocab=8)  # the config needs no transformers
    with pytest.raises(ValueError, match=message):
        family.spec(cfg)


def test_loss_is_computed_in_float32_or_wider():
    loss = get_family("llama").spec(get_family("llama").config(layers=2, hidden=8, heads=2, seq=4, vocab=8)).loss
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([[1, 2, 3], [4, 0, 1]])
    low = loss(logits.to(torch.bfloat16), y)
    assert low.dtype == torch.float32
    assert low.item() == pytest.approx(loss(logits.to(torch.bfloat16).float(), y).item(), abs=0)
    assert loss(logits.double(), y).dtype == torch.float64


def _top_level_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.parse(path.read_text()).body:  # module level only: functions import on use
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
    return found


def test_configs_layout_and_registry_import_no_torch_and_nothing_imports_transformers():
    models = Path(pipeblocks.__file__).parent / "models"
    torch_free = {"config", "llama_config", "layout", "family", "__init__"}
    for stem in torch_free:
        imports = _top_level_imports(models / f"{stem}.py")
        assert "torch" not in imports, stem
        assert {m for m in imports if m.startswith(".")} <= {".config", ".llama_config", "..core.cost.split", "..core.util.lazy"}, stem
    for path in Path(pipeblocks.__file__).parent.rglob("*.py"):
        assert "transformers" not in _top_level_imports(path), path
