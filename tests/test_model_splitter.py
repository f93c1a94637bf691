"""The generic splitter on small custom models: stages compose to exactly the model, built
alone or sharing its parameters, with its names; buffers keep their values; bad layouts and
bad input are refused with one clear line each."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipeblocks.core import Placement
from pipeblocks.core.cost.split import layer_counts
from pipeblocks.models import BlockAdapter, Layout, allocate_stages, split_model
from pipeblocks.models.layout import layer_ranges
from pipeblocks.models.splitter import resolve
from pipeblocks.models.init import seeded_normal_

pytestmark = pytest.mark.torch

F64 = torch.float64
H, SEQ, VOCAB = 8, 6, 11


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H, dtype=F64)
        self.fc = nn.Linear(H, H, dtype=F64)
        self.register_buffer("scale", torch.linspace(0.5, 1.0, H, dtype=F64))  # persistent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * torch.tanh(self.fc(self.norm(x)))


class Tiny(nn.Module):
    """Blocks in a top-level `layers`, a name the stages also use for their block range."""

    def __init__(self, blocks: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H, dtype=F64)
        self.layers = nn.ModuleList(Residual() for _ in range(blocks))
        self.norm = nn.LayerNorm(H, dtype=F64)
        self.head = nn.Linear(H, VOCAB, dtype=F64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


TINY = Layout(blocks="layers", before=("embed",), after=("norm", "head"))


class Positions(nn.Module):
    """Parameter-free: a sinusoid table as a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        pos = torch.arange(SEQ, dtype=F64)[:, None] / 10 ** (torch.arange(H, dtype=F64) / H)
        self.register_buffer("table", torch.sin(pos + 1), persistent=False)

    def forward(self, s: int) -> torch.Tensor:
        return self.table[:s]


class PosBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H, dtype=F64)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x + pos))


class Nested(nn.Module):
    """Parts at nested paths; blocks take a side input from a shared module."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H, dtype=F64)
        self.trunk = nn.Module()
        self.trunk.pos = Positions()
        self.trunk.blocks = nn.ModuleList(PosBlock() for _ in range(blocks))
        self.out = nn.Module()
        self.out.head = nn.Linear(H, VOCAB, bias=False, dtype=F64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        pos = self.trunk.pos(idx.size(1))
        for block in self.trunk.blocks:
            x = block(x, pos)
        return self.out.head(x)


NESTED = Layout(blocks="trunk.blocks", before=("embed",), after=("out.head",), shared=("trunk.pos",))


class PosAdapter(BlockAdapter):
    def context(self, stage, h, chunk):
        return stage.part("trunk.pos")(h.size(1))

    def run_block(self, name, block, h, ctx):
        return block(h, ctx)


def _init(seed: int):
    def init(name: str, param: torch.Tensor) -> None:
        seeded_normal_(param, seed=seed, name=name, std=0.3)
    return init


def _model(cls, seed: int = 0) -> nn.Module:
    model = cls()
    fill = _init(seed)
    for name, param in model.named_parameters():
        fill(name, param)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return torch.randint(0, VOCAB, (3, SEQ), generator=g), torch.randint(0, VOCAB, (3, SEQ), generator=g)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _assert_exact(full: nn.Module, stages: list[nn.Module]) -> None:
    """Chained stages give the model's loss and every gradient (float64, 1e-10 relative)."""
    x, y = _batch()
    assert [s.index for s in stages] == list(range(len(stages)))
    h = x
    for stage in stages:
        h = stage(h)
    loss, want = _loss(h, y), _loss(full(x), y)
    assert math.isclose(loss.item(), want.item(), rel_tol=1e-10)
    loss.backward()
    want.backward()
    got = {n: p.grad for s in stages for n, p in s.named_parameters()}
    assert got.keys() == dict(full.named_parameters()).keys()
    for name, p in full.named_parameters():
        err = (got[name] - p.grad).abs().max().item() / max(p.grad.abs().max().item(), 1e-300)
        assert err <= 1e-10, f"{name}: relative error {err:.3g}"


CASES = [(Tiny, TINY, None), (Nested, NESTED, PosAdapter())]
IDS = ["tiny", "nested-shared"]


@pytest.mark.parametrize("cls, layout, adapter", CASES, ids=IDS)
def test_split_model_shares_parameters_and_names(cls, layout, adapter):
    full = _model(cls)
    stages = split_model(full, layout, 3, adapter=adapter)
    assert [s.block_indices for s in stages] == list(layer_ranges(layer_counts(len(resolve(full, layout.blocks)), 3)))
    assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in full.parameters()}
    merged = {k: v for s in stages for k, v in s.state_dict().items()}
    assert merged.keys() == full.state_dict().keys()
    assert stages[0].is_first and stages[-1].is_last and not stages[1].is_first and not stages[1].is_last
    _assert_exact(full, stages)


def test_stage_attributes_survive_a_model_part_of_the_same_name():
    stages = split_model(_model(Tiny), TINY, 2)
    assert [s.block_indices for s in stages] == [range(0, 3), range(3, 5)]  # layer_counts(5, 2): ends lighter
    assert isinstance(stages[0].part("layers"), nn.ModuleDict) and list(stages[1].part("layers")) == ["3", "4"]
    assert [n for n, _ in stages[1].block_items()] == ["layers.3", "layers.4"]
    assert "layers.4.fc.weight" in dict(stages[1].named_parameters())


@pytest.mark.parametrize("placement", [Placement.loop(2, 2), Placement.v_shape(2)], ids=["loop-2x2", "v-2"])
@pytest.mark.parametrize("cls, layout, adapter", CASES, ids=IDS)
@pytest.mark.parametrize("source", ["init", "state_dict"])
def test_allocated_stages_compose_to_the_model(placement, cls, layout, adapter, source):
    full = _model(cls, seed=5)
    S = placement.num_stages
    weights = {"init": _init(5)} if source == "init" else {"state_dict": full.state_dict()}
    by_stage = {}
    for rank in range(placement.num_ranks):
        mine = allocate_stages(cls, layout, num_stages=S, stages=placement.stages_of(rank), adapter=adapter,
                               **weights)
        assert [s.index for s in mine] == list(placement.stages_of(rank))
        by_stage.update({s.index: s for s in mine})
    stages = [by_stage[s] for s in range(S)]
    # no tensor is left as uninitialised memory: parameters and every buffer, persistent or not
    buffers = dict(full.named_buffers())
    for stage in stages:
        for name, b in stage.named_buffers():
            assert torch.equal(b, buffers[name]), name
    _assert_exact(full, stages)


def test_allocate_builds_on_the_meta_device_first():
    built = []

    def make() -> nn.Module:
        model = Tiny(blocks=4)
        built.append({p.device.type for p in model.parameters()})
        return model

    stages = allocate_stages(make, TINY, num_stages=4, stages=[2], init=_init(0))
    assert built == [{"meta"}] and len(stages) == 1
    assert {p.device.type for p in stages[0].parameters()} == {"cpu"}
    assert Tiny().embed.weight.device.type == "cpu"  # the hook is gone after the call


def test_explicit_counts():
    stages = split_model(_model(Tiny), TINY, 2, counts=(1, 4))
    assert [s.block_indices for s in stages] == [range(0, 1), range(1, 5)]
    assert [s.index for s in split_model(_model(Tiny), TINY, 3, stages=(2, 0))] == [2, 0]


def test_default_adapter_refuses_sequence_chunks():
    stage = split_model(_model(Tiny), TINY, 1)[0]
    assert not stage.supports_sequence_chunks

    class Chunk:
        offset = 0

    with pytest.raises(ValueError, match="stage 0 cannot run sequence chunks.*without --seq-chunks"):
        stage(_batch()[0], chunk=Chunk())


@pytest.mark.parametrize(
    "layout, num_stages, kwargs, message",
    [
        (Layout(blocks="blocks", before=("embed",), after=("norm", "head")), 2, {},
         r"module path 'blocks' does not exist in Tiny: no 'blocks' at the top level; the model's top-level "
         r"children are: embed, layers, norm, head"),
        (Layout(blocks="layers.9", before=("embed",), after=("norm", "head")), 2, {},
         r"no '9' at layers; 'layers' has 0, 1, 2, 3, 4"),
        (Layout(blocks="embed", before=("layers",), after=("norm", "head")), 2, {},
         "blocks path 'embed' is a Embedding, not an nn.ModuleList"),
        (TINY, 6, {}, "'layers' holds 5 blocks but the pipeline has 6 stages"),
        (TINY, 2, {"counts": (5, 0)}, r"layer counts \[5, 0\] do not fit 2 stages of 5 blocks.*each >= 1"),
        (TINY, 2, {"counts": (2, 2)}, "summing to 5"),
        (Layout(blocks="layers", before=("embed",), after=("head",)), 2, {},
         r"norm.weight, norm.bias lie outside the layout.*add their modules to before= .* or after="),
        (Layout(blocks="layers", before=("embed",), after=("head",), shared=("norm",)), 2, {},
         "shared module 'norm' holds parameters"),
        (TINY, 2, {"stages": (0, 2)}, r"stage 2 is out of range: the pipeline has stages 0..1"),
    ],
)
def test_bad_layouts_and_splits_are_refused(layout, num_stages, kwargs, message):
    with pytest.raises(ValueError, match=message):
        split_model(_model(Tiny), layout, num_stages, **kwargs)


def test_nested_path_errors_list_the_children_where_they_failed():
    with pytest.raises(ValueError, match=r"no 'layer' at trunk; 'trunk' has pos, blocks; the model's top-level "
                                         r"children are: embed, trunk, out"):
        split_model(_model(Nested), Layout(blocks="trunk.layer", before=("embed",)), 2)


def test_layout_paths_are_checked():
    with pytest.raises(ValueError, match="layout paths overlap: 'model' and 'model.layers'"):
        Layout(blocks="model.layers", before=("model",))
    with pytest.raises(TypeError, match=r"write before=\('embed',\)"):
        Layout(blocks="layers", before="embed")
    with pytest.raises(ValueError, match="bad module path 'a..b'"):
        Layout(blocks="a..b")


def test_tied_weights_other_than_the_head_are_refused():
    model = _model(Tiny)
    model.layers[1].fc.weight = model.layers[0].fc.weight
    with pytest.raises(ValueError, match="layers.1.fc.weight and layers.0.fc.weight are one parameter.*untie the others"):
        split_model(model, TINY, 2)


class TiedTiny(Tiny):
    """Tiny whose head shares the embedding's weight (a bias-free head of V x H)."""

    def __init__(self, blocks: int = 5) -> None:
        super().__init__(blocks)
        self.head = nn.Linear(H, VOCAB, bias=False, dtype=F64)
        self.head.weight = self.embed.weight


def test_a_head_tied_to_the_embedding_is_recorded_and_built_as_two_equal_copies():
    model = _model(TiedTiny)
    stages = split_model(model, TINY, 2)  # one process: the stages share the one parameter
    assert stages[0].tied == stages[1].tied == (("embed.weight", "head.weight"),)
    assert stages[1].part("head").weight is stages[0].part("embed").weight
    assert set(stages[0].tied_here) == {"embed.weight"} and set(stages[1].tied_here) == {"head.weight"}
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    assert torch.equal(stages[1](stages[0](tokens)), model(tokens))
    # built apart (a V rank holds stages 0 and 3): a copy each, filled from the embedding's name
    init_calls = []

    def init(name, tensor):
        init_calls.append(name)
        seeded_normal_(tensor, seed=0, name=name, std=0.5)

    first, last = allocate_stages(TiedTiny, TINY, num_stages=4, stages=[0, 3], init=init)
    head, embed = last.part("head").weight, first.part("embed").weight
    assert head is not embed and torch.equal(head, embed) and "head.weight" not in init_calls
    # from a state dict that holds the weight once, as tied checkpoints do
    weights = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    (alone,) = allocate_stages(TiedTiny, TINY, num_stages=2, stages=[1], state_dict=weights)
    assert torch.equal(alone.part("head").weight, model.embed.weight)


def test_allocate_needs_weights_and_every_key():
    with pytest.raises(ValueError, match="exactly one of init= .* state_dict= .* or weights="):
        allocate_stages(Tiny, TINY, num_stages=2, stages=[0])
    partial = {k: v for k, v in _model(Tiny).state_dict().items() if not k.startswith("layers.4.")}
    assert len(allocate_stages(Tiny, TINY, num_stages=2, stages=[0], state_dict=partial)) == 1
    with pytest.raises(ValueError, match=r"stage 1: the state dict has no layers.4.scale, layers.4.norm.weight, "
                                         r"layers.4.norm.bias and 2 more; give the full model's state dict"):
        allocate_stages(Tiny, TINY, num_stages=2, stages=[1], state_dict=partial)
