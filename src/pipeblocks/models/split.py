"""Cut the reference GPT into S pipeline stages.

    >>> model = GPT(GPTConfig(layers=6), seed=0)
    >>> stages = split_gpt(model, 4)                     # shares parameters with `model`
    >>> [s.layers for s in stages]
    [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]
    >>> mine = build_stages(model.config, seed=0, num_stages=4, stages=(0, 3))   # one V rank, p=2

Global stage s always holds the s-th contiguous slice of blocks, whatever the placement:
the placement (loop: stage s on rank s mod p; V: rank i holds stages i and 2p-1-i) only
decides which rank runs it, so a rank asks for `placement.stages_of(rank)`.

How layers are counted: `pipeblocks.core.split.layer_counts`, the rule the analytic cost
model uses too. Only transformer blocks count; the embedding (a table lookup) rides on
stage 0 and the final norm + LM head on stage S-1 (the head costs about vocab/(12·hidden)
of a block's FLOPs, a third for the defaults), so the extra blocks of an uneven split go
to the middle stages first:

    layers=10, S=4  ->  2 3 3 2        layers=5, S=2  ->  3 2        layers=7, S=4  ->  2 2 2 1
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
from torch import Tensor, nn

from ..core.split import layer_counts
from .config import GPTConfig
from .gpt import GPT, Block, Embedding, Head, KVExtender, init_parameters

__all__ = ["GPTStage", "layer_counts", "layer_ranges", "split_gpt", "build_stages"]


class SequenceChunkLike(Protocol):
    """What a stage reads of the runtime's `SequenceChunk` (kept a protocol: models do not import the runtime)."""

    offset: int

    def kv(self, layer: str) -> KVExtender: ...


def layer_ranges(counts: Sequence[int]) -> tuple[range, ...]:
    """Block index ranges from per-stage counts."""
    ranges, start = [], 0
    for n in counts:
        ranges.append(range(start, start + n))
        start += n
    return tuple(ranges)


class GPTStage(nn.Module):
    """One pipeline stage: [embedding] + a slice of blocks + [final norm and head].

    forward takes one tensor and returns one: token ids [b, s] -> hidden [b, s, h] on
    stage 0, hidden -> hidden in the middle, hidden -> logits [b, s, vocab] on the last.
    Parameter names match the full model's (`blocks.3.attn.qkv.weight`, ...).

    Sequence chunks (Seq1F1B): `forward(x, chunk=c)` runs the tokens
    [c.offset, c.offset + c.length) of a microbatch: positions start at c.offset and every
    block's attention takes its K/V over the earlier chunks from `c.kv("blocks.<i>")`
    (`pipeblocks.runtime.sequence.SequenceChunk`, the runtime's stage contract).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        *,
        index: int,
        num_stages: int,
        layers: range,
        embed: Embedding | None,
        blocks: Sequence[Block],
        head: Head | None,
    ) -> None:
        super().__init__()
        if len(blocks) != len(layers):
            raise ValueError(f"stage {index}: {len(blocks)} blocks given for layers {layers}")
        self.config = cfg
        self.index = index
        self.num_stages = num_stages
        self.layers = layers
        self.embed = embed
        self.blocks = nn.ModuleDict({str(i): b for i, b in zip(layers, blocks)})
        self.head = head

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, x: Tensor, chunk: SequenceChunkLike | None = None) -> Tensor:
        if self.embed is not None:
            x = self.embed(x, chunk.offset if chunk is not None else 0)
        for name, block in self.blocks.items():
            x = block(x, chunk.kv(f"blocks.{name}") if chunk is not None else None)
        if self.head is not None:
            x = self.head(x)
        return x

    def extra_repr(self) -> str:
        return f"stage={self.index}/{self.num_stages}, layers={self.layers.start}..{self.layers.stop - 1}"


def split_gpt(model: GPT, num_stages: int, *, counts: Sequence[int] | None = None) -> list[GPTStage]:
    """All S stages of `model`, sharing its parameters (a gradient on a stage is on the model)."""
    ranges = _ranges(model.config, num_stages, counts)
    return [
        GPTStage(
            model.config, index=s, num_stages=num_stages, layers=r,
            embed=model.embed if s == 0 else None,
            blocks=[model.blocks[i] for i in r],
            head=model.head if s == num_stages - 1 else None,
        )
        for s, r in enumerate(ranges)
    ]


def build_stages(
    cfg: GPTConfig,
    *,
    seed: int,
    num_stages: int,
    stages: Sequence[int],
    counts: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> list[GPTStage]:
    """Build only the listed stages, with the weights `GPT(cfg, seed=seed)` would have.

    A pipeline rank calls this with `placement.stages_of(rank)`; nothing else of the model
    is allocated.
    """
    ranges = _ranges(cfg, num_stages, counts)
    built = []
    for s in stages:
        if not 0 <= s < num_stages:
            raise ValueError(f"stage {s} is out of range: the pipeline has stages 0..{num_stages - 1}")
        stage = GPTStage(
            cfg, index=s, num_stages=num_stages, layers=ranges[s],
            embed=Embedding(cfg) if s == 0 else None,
            blocks=[Block(cfg) for _ in ranges[s]],
            head=Head(cfg) if s == num_stages - 1 else None,
        )
        init_parameters(stage, cfg, seed=seed)
        built.append(stage.to(device) if device is not None else stage)
    return built


def _ranges(cfg: GPTConfig, num_stages: int, counts: Sequence[int] | None) -> tuple[range, ...]:
    if counts is None:
        return layer_ranges(layer_counts(cfg.layers, num_stages))
    counts = tuple(counts)
    if len(counts) != num_stages or sum(counts) != cfg.layers or min(counts) < 1:
        raise ValueError(
            f"layer counts {list(counts)} do not fit {num_stages} stages of a {cfg.layers}-layer model: "
            f"give {num_stages} counts, each >= 1, summing to {cfg.layers}"
        )
    return layer_ranges(counts)
