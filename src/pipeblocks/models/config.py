"""The reference GPT's shape: a typed, frozen config that imports nothing heavy.

    >>> GPTConfig(layers=8, hidden=64, heads=4, seq=64, vocab=256, dtype="float64")

Kept apart from gpt.py so the command line can read the defaults without importing torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, TypeVar

__all__ = ["GPTConfig", "DTypeName"]

DTypeName = Literal["float32", "float64"]
DTYPES = ("float32", "float64")
_Config = TypeVar("_Config", bound="FamilyConfig")


class FamilyConfig:
    """What the built-in families' configs share: the torch dtype, the head width and JSON."""

    dtype: DTypeName
    hidden: int
    heads: int

    @property
    def torch_dtype(self):
        """The torch dtype (torch is imported here, so the config itself stays torch-free)."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls: type[_Config], data: dict) -> _Config:
        return cls(**data)

    def _check_counts(self, names: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
        """Each field of `names`, and of `optional` unless it is None, an integer >= 1."""
        for name in (*names, *(name for name in optional if getattr(self, name) is not None)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class GPTConfig(FamilyConfig):
    """Shape of the reference GPT. Defaults train in seconds on a laptop CPU."""

    layers: int = 8
    """Transformer blocks (the embedding and the head are not counted); 8 fill V schedules up to p=4."""
    hidden: int = 64
    """Model width h."""
    heads: int = 4
    """Attention heads a; must divide hidden."""
    seq: int = 64
    """Context length s: the longest sequence the position table covers."""
    vocab: int = 256
    """Vocabulary size (256 for the byte tokenizer)."""
    dtype: DTypeName = "float32"
    """Parameter and activation dtype: "float32" or "float64"."""
    mlp_ratio: int = 4
    """MLP inner width, as a multiple of hidden."""

    def __post_init__(self) -> None:
        self._check_counts(("layers", "hidden", "heads", "seq", "vocab", "mlp_ratio"))
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be a multiple of heads ({self.heads}): "
                f"change --hidden to e.g. {self.heads * max(1, round(self.hidden / self.heads))} or --heads"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
