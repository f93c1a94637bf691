"""A tiny attention-free language model cut into stages, for runtime tests and benchmarks.

Stage 0 embeds token ids `LongTensor[b, s]`; every stage holds `blocks_per_stage` residual
MLP blocks; the last stage ends in a norm and a head that returns logits `[b, s, vocab]`.
`toy_stages` builds the same weights in every process from a seed, so each rank can keep
only its stages while a reference process runs them all. With `with_vocab=False` no stage
holds the embedding or the head (vocabulary parallelism, `runtime.vocab_step`): every stage
maps [b, s, hidden] to [b, s, hidden], the last ending at its norm.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .spec import cross_entropy  # the toy's loss is every spec's default (its users import it from here)

__all__ = ["ToyConfig", "toy_stages", "toy_batch", "cross_entropy"]


@dataclass(frozen=True)
class ToyConfig:
    """vocab: token count.  hidden: width.  blocks_per_stage: MLP blocks in each stage.  seq: tokens per sample."""

    vocab: int = 11
    hidden: int = 8
    blocks_per_stage: int = 1
    seq: int = 5


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Stage(nn.Module):
    def __init__(self, config: ToyConfig, first: bool, last: bool, with_vocab: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.hidden) if first and with_vocab else None
        self.blocks = nn.Sequential(*(_Block(config.hidden) for _ in range(config.blocks_per_stage)))
        self.norm = nn.LayerNorm(config.hidden) if last else None
        self.head = nn.Linear(config.hidden, config.vocab) if last and with_vocab else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.blocks(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


def toy_stages(num_stages: int, config: ToyConfig = ToyConfig(), *, seed: int = 0,
               dtype: torch.dtype = torch.float64, with_vocab: bool = True) -> list[nn.Module]:
    """All stages of the model, with weights fixed by `seed`; `with_vocab=False`: without the
    embedding and the head (module doc)."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        stages = [_Stage(config, s == 0, s == num_stages - 1, with_vocab).to(dtype) for s in range(num_stages)]
    finally:
        torch.random.set_rng_state(generator_state)
    return stages


def toy_batch(batch: int, config: ToyConfig = ToyConfig(), *, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [batch, seq], next-token targets [batch, seq])."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab, (batch, config.seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
