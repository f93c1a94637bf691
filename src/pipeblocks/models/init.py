"""Weights from (seed, parameter name) alone, so any subset of a model can be built by itself.

    >>> seeded_normal_(param, seed=0, name="blocks.3.mlp.up.weight", std=0.02)

Values are drawn on the CPU in float64 from a generator seeded by the seed and the name's
CRC, then cast and copied: the same name gets the same values on any device and in any
stage, and a float32 and a float64 model from one seed agree to float32 rounding.
"""
from __future__ import annotations

import zlib

import torch
from torch import Tensor

__all__ = ["normal_init", "param_seed", "seeded_normal_"]


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name` under the model seed `seed`."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


def seeded_normal_(tensor: Tensor, *, seed: int, name: str, std: float) -> Tensor:
    """Fill `tensor` in place with N(0, std²) values fixed by (seed, name); returns it."""
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    values = torch.randn(tensor.shape, generator=gen, dtype=torch.float64) * std
    with torch.no_grad():
        return tensor.copy_(values.to(tensor.dtype))


def normal_init(seed: int, std: float = 0.02, *, residual: tuple[str, ...] = (), residual_std: float = 0.0):
    """`init(name, tensor)`: norms' weights one, every other parameter N(0, std²) from (seed, name),
    as transformers draws a fresh model's weights; those whose names end in one of `residual`
    N(0, residual_std²) instead (GPT-2's scaled residual projections)."""

    def init(name: str, tensor: Tensor) -> None:
        with torch.no_grad():
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            else:
                seeded_normal_(tensor, seed=seed, name=name, std=residual_std if name.endswith(residual) else std)

    return init
