"""One pipeline stage of any model: a slice of its blocks, and its first or last parts.

A stage holds the model's own modules at the model's own paths, so its parameter names are
the full model's (`model.layers.3.self_attn.q_proj.weight`) and the union of the stages'
state dicts is the model's state dict. Containers stand in for the levels of a path (a
plain `nn.Module` for "model", an `nn.ModuleDict` keyed by the global block index for
"model.layers"). Build stages with `pipeblocks.models.splitter`; a stage reads:

    stage.index, stage.num_stages      global stage s of S
    stage.block_indices                range of global block indices it holds
    stage.is_first, stage.is_last      whether it holds the before / after modules
    stage.supports_sequence_chunks     whether forward takes chunk= (Seq1F1B)
    stage.part("model.norm")           one of its modules, by its path in the full model
    stage.tied                         the model's tied embedding/head pairs (TiedPair: first, last)
    stage.tied_here                    those of them whose parameter this stage holds, by name
    stage(x), stage(x, chunk=c)        token ids or hidden state in, hidden state or logits out
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from torch import nn

from .adapter import BlockAdapter, SequenceChunkLike
from .layout import Layout

__all__ = ["Stage", "TiedPair"]


class TiedPair(NamedTuple):
    """A head weight that is the embedding's (tied embeddings), by full-model names."""

    first: str
    """the parameter's name on the first stage: "model.embed_tokens.weight" """
    last: str
    """the copy's name on the last stage: "lm_head.weight" """


class Stage(nn.Module):
    """Stage `index` of `num_stages`: blocks `layers` of `layout.blocks` (kept as `block_indices`:
    `layers` is a common name for a model's own block list, which the stage mirrors), plus its end parts.

    parts: the modules of `layout.before` (stage 0), `layout.after` (last stage) and
    `layout.shared` (every stage) by path; blocks: the block of every index in `layers`.
    """

    def __init__(
        self,
        *,
        index: int,
        num_stages: int,
        layers: range,
        layout: Layout,
        parts: Mapping[str, nn.Module],
        blocks: Mapping[int, nn.Module],
        adapter: BlockAdapter | None = None,
        tied: tuple[TiedPair, ...] = (),
    ) -> None:
        super().__init__()
        if sorted(blocks) != list(layers):
            raise ValueError(f"stage {index}: blocks {sorted(blocks)} given for layers {list(layers)}")
        self.index = index
        self.num_stages = num_stages
        self.block_indices = layers
        self.layout = layout
        self.adapter = adapter if adapter is not None else BlockAdapter()
        self.tied = tuple(TiedPair(*pair) for pair in tied)
        self._before = tuple(p for p in layout.before if p in parts)
        self._after = tuple(p for p in layout.after if p in parts)
        # Written into `_modules` directly: a model part may share a name with a stage
        # attribute (a top-level "layers" list is common), and the part must not replace it.
        # In the order they run (before, shared, blocks, after): parameters() follows it, as
        # the whole model's does, and so do the optimizer's state and the memory model's shapes.
        for path in (*self._before, *(p for p in layout.shared if p in parts)):
            self._mirror(path, parts[path])
        self._mirror(layout.blocks, nn.ModuleDict({str(i): blocks[i] for i in layers}))
        for path in self._after:
            self._mirror(path, parts[path])
        unplaced = set(parts) - {*self._before, *self._after, *layout.shared}
        if unplaced:
            raise ValueError(f"stage {index}: parts {sorted(unplaced)} are not in the layout's before, after or shared")

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def tied_here(self) -> dict[str, TiedPair]:
        """This stage's parameters that are one end of a tie: {name: pair} (the first stage
        holds `pair.first`, the last `pair.last`; one stage of a one-stage model holds both)."""
        held = {}
        for pair in self.tied:
            if self.is_first:
                held[pair.first] = pair
            if self.is_last:
                held[pair.last] = pair
        return held

    @property
    def supports_sequence_chunks(self) -> bool:
        return bool(self.adapter.supports_sequence_chunks)

    def part(self, path: str) -> nn.Module:
        """The module at `path` (a path of the full model) in this stage."""
        module: nn.Module = self
        for atom in path.split("."):
            child = module._modules.get(atom)
            if child is None:
                raise KeyError(f"stage {self.index} holds no {path!r} (it has {', '.join(self._modules) or 'nothing'})")
            module = child
        return module

    def block_items(self) -> list[tuple[str, nn.Module]]:
        """(full name, block) of this stage's blocks in order: [("model.layers.3", block), ...]."""
        container = self.part(self.layout.blocks)
        return [(f"{self.layout.blocks}.{i}", container._modules[str(i)]) for i in self.block_indices]

    def forward(self, x: Any, chunk: SequenceChunkLike | None = None) -> Any:
        """Run this stage on `x`; `chunk`: which slice of the sequence `x` holds (Seq1F1B)."""
        adapter = self.adapter
        if chunk is not None and not adapter.supports_sequence_chunks:
            raise ValueError(
                f"stage {self.index} cannot run sequence chunks: its adapter {type(adapter).__name__} does not support "
                "them (supports_sequence_chunks is False); use a schedule without --seq-chunks"
            )
        for path in self._before:
            x = adapter.run_before(path, self.part(path), x, chunk)
        ctx = adapter.context(self, x, chunk)
        for name, block in self.block_items():
            x = adapter.run_block(name, block, x, ctx)
        for path in self._after:
            x = adapter.run_after(path, self.part(path), x, ctx)
        return x

    def extra_repr(self) -> str:
        return f"stage={self.index}/{self.num_stages}, layers={self.block_indices.start}..{self.block_indices.stop - 1}"

    def _mirror(self, path: str, module: nn.Module) -> None:
        *parents, leaf = path.split(".")
        owner: nn.Module = self
        for atom in parents:
            if atom not in owner._modules:
                owner._modules[atom] = nn.Module()
            owner = owner._modules[atom]
        owner._modules[leaf] = module
