"""Models and their split into pipeline stages: the splitter for any model with a block list,
the reference GPT, a Llama-style model, Hugging Face's Llama, and the family registry.

    splitter    Layout, split_model, allocate_stages, Stage, BlockAdapter   (bring your own model)
    gpt         GPTConfig, GPT, split_gpt, build_stages, GPTStage
    llama       LlamaConfig, Llama, split_llama, build_llama_stages
    hf-llama    pipeblocks.models.hf_llama (needs transformers)
    families    get_family("gpt" | "llama" | "hf-llama"), family_names()

Names are imported on first use, so `from pipeblocks.models import GPTConfig` (and
LlamaConfig, Layout, get_family, and the command line) does not import torch; `GPT`,
`split_gpt`, `split_model` and the rest do. Nothing here imports transformers.
"""
from __future__ import annotations

import importlib

__all__ = [
    "GPTConfig", "GPT", "causal_attention", "cross_entropy",
    "GPTStage", "build_stages", "layer_counts", "layer_ranges", "split_gpt",
    "LlamaConfig", "Llama", "split_llama", "build_llama_stages",
    "Layout", "Stage", "BlockAdapter", "split_model", "allocate_stages",
    "Family", "get_family", "family_names",
]

_HOME = {
    "GPTConfig": "config", "GPT": "gpt", "causal_attention": "gpt", "cross_entropy": "gpt",
    "GPTStage": "split", "build_stages": "split", "layer_counts": "split", "layer_ranges": "split",
    "split_gpt": "split",
    "LlamaConfig": "llama_config", "Llama": "llama", "split_llama": "llama", "build_llama_stages": "llama",
    "Layout": "layout", "Stage": "stage", "BlockAdapter": "adapter", "split_model": "splitter",
    "allocate_stages": "splitter",
    "Family": "family", "get_family": "family", "family_names": "family",
}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
