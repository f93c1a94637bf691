"""A user's ModelSpec for the tests: a four-block attention-free language model of width 32,
found as `tests/_user_spec.py:SPEC` or, once this module is imported, as "tiny-lm"."""
from __future__ import annotations

import zlib

import torch
from torch import nn

from pipeblocks.models import Layout, ModelShape, ModelSpec, register_model

VOCAB, WIDTH, BLOCKS = 256, 32, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def init(seed: int):
    def fill(name, tensor):
        generator = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
        tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
    return fill


SPEC = ModelSpec(name="tiny-lm", build=TinyLM, layout=Layout(blocks="layers", before=("embed",), after=("head",)),
                 shape=ModelShape(layers=BLOCKS, hidden=WIDTH, heads=4, vocab=VOCAB, ffn=WIDTH, positions="rotary"),
                 init=init)
register_model("tiny-lm", SPEC)
