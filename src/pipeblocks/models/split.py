"""Cut the reference GPT into S pipeline stages (the generic splitter with GPT's layout).

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

Parameter names are the full model's (`embed.*`, `blocks.<i>.*`, `head.*`). Sequence chunks
(Seq1F1B): `stage(x, chunk=c)` runs the tokens [c.offset, c.offset + c.length) of a
microbatch: positions start at c.offset and every block's attention takes its K/V over the
earlier chunks from `c.kv("blocks.<i>")` (`pipeblocks.runtime.sequence.SequenceChunk`).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..core.split import layer_counts
from .adapter import BlockAdapter
from .config import GPTConfig
from .gpt import GPT, parameter_init
from .layout import Layout, block_ranges, layer_ranges
from .splitter import allocate_stages, split_model
from .stage import Stage

__all__ = ["GPTStage", "GPTAdapter", "GPT_LAYOUT", "layer_counts", "layer_ranges", "split_gpt", "build_stages"]

GPT_LAYOUT = Layout(blocks="blocks", before=("embed",), after=("head",))

GPTStage = Stage
"""A stage of the reference GPT: [embedding] + a slice of blocks + [final norm and head]."""


class GPTAdapter(BlockAdapter):
    """The embedding takes the chunk's position offset; each block takes its K/V extender."""

    supports_sequence_chunks = True

    def run_before(self, name, module, x, chunk):
        return module(x, chunk.offset if chunk is not None else 0)

    def run_block(self, name: str, block: nn.Module, h, ctx):
        return block(h, ctx.kv(name) if ctx is not None else None)


def split_gpt(model: GPT, num_stages: int, *, counts: Sequence[int] | None = None) -> list[Stage]:
    """All S stages of `model`, sharing its parameters (a gradient on a stage is on the model)."""
    return split_model(model, GPT_LAYOUT, num_stages, adapter=GPTAdapter(), counts=counts)


def build_stages(
    cfg: GPTConfig,
    *,
    seed: int,
    num_stages: int,
    stages: Sequence[int],
    counts: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> list[Stage]:
    """Build only the listed stages, with the weights `GPT(cfg, seed=seed)` would have.

    A pipeline rank calls this with `placement.stages_of(rank)`; nothing else of the model
    is allocated.
    """
    block_ranges(cfg.layers, num_stages, counts)  # the config's errors before any module is built
    return allocate_stages(
        lambda: GPT(cfg, seed=seed), GPT_LAYOUT, num_stages=num_stages, stages=stages, device=device,
        init=parameter_init(cfg, seed=seed), adapter=GPTAdapter(), counts=counts,
    )
