"""The reference GPT and its split into pipeline stages.

Names are imported on first use, so `from pipeblocks.models import GPTConfig` (and the
command line) does not import torch; `GPT`, `split_gpt` and the rest do.
"""
from __future__ import annotations

import importlib

__all__ = [
    "GPTConfig", "GPT", "causal_attention", "cross_entropy",
    "GPTStage", "build_stages", "layer_counts", "layer_ranges", "split_gpt",
]

_HOME = {
    "GPTConfig": "config", "GPT": "gpt", "causal_attention": "gpt", "cross_entropy": "gpt",
    "GPTStage": "split", "build_stages": "split", "layer_counts": "split", "layer_ranges": "split",
    "split_gpt": "split",
}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
