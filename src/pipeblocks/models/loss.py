"""The next-token loss the built-in models train with, and every `ModelSpec`'s default."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["cross_entropy"]


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy: logits [b, s, V], targets LongTensor [b, s].

    Computed in float32 or wider: bfloat16 or float16 logits are upcast first.
    """
    import torch  # torch is heavy: model specs are read on the torch-free command-line paths

    if logits.is_floating_point() and torch.finfo(logits.dtype).bits < 32:
        logits = logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
