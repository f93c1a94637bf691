"""The built-in models by name: `--model-family gpt | llama | hf-llama`.

    >>> fam = get_family("llama")
    >>> cfg = fam.config(layers=8, hidden=64, heads=4, kv_heads=2, seq=64, vocab=256, dtype="float32")
    >>> spec = fam.spec(cfg)              # its ModelSpec: build, layout, shape, init, loss, tp plan
    >>> spec.describe()
    '8-layer Llama (hidden 64, 4 heads, 2 KV heads)'

Families:
    gpt        the reference GPT (learned positions, LayerNorm, GELU MLP); GPTConfig
    llama      the built-in Llama-style model (RMSNorm, rotary, SwiGLU, grouped-query attention); LlamaConfig
    hf-llama   Hugging Face transformers' LlamaForCausalLM of the same LlamaConfig (needs transformers)

A family is only a name, a config type and the function that makes its spec: everything
else (building stages, the reference, the loss, the tensor-parallel plan) is the spec's,
on the path every model takes (`models.build`). Importing this module imports neither
torch nor transformers; asking for hf-llama without transformers is a one-line ValueError.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from .config import GPTConfig
from .llama_config import LlamaConfig

__all__ = ["Family", "FAMILIES", "MISSING_TRANSFORMERS", "get_family", "family_names"]

MISSING_TRANSFORMERS = "--model-family hf-llama needs transformers: pip install -e .[hf] (or pip install transformers)"


@dataclass(frozen=True)
class Family:
    """A built-in model: its config type and where its spec is made ("module:function", imported on use)."""

    name: str
    title: str
    config_type: type
    spec_factory: str
    """`f(config)` -> the family's ModelSpec for that config."""
    requires: str | None = None
    """An optional package it needs (checked by `get_family`)."""

    def config(self, *, layers: int, hidden: int, heads: int, seq: int, vocab: int, dtype: str = "float32",
               kv_heads: int | None = None) -> GPTConfig | LlamaConfig:
        """The family's config from CLI-like fields; kv_heads applies to the Llama families only."""
        if self.config_type is GPTConfig:
            if kv_heads is not None and kv_heads != heads:
                raise ValueError(f"--kv-heads {kv_heads} applies to the llama and hf-llama families; the {self.name} "
                                 "family has one K/V head per query head: drop --kv-heads")
            return GPTConfig(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, dtype=dtype)
        return LlamaConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, seq=seq, vocab=vocab,
                           dtype=dtype)

    def spec(self, config: Any):
        """The `ModelSpec` of this family's model of `config`."""
        if not isinstance(config, self.config_type):
            raise TypeError(f"the {self.name} family takes a {self.config_type.__name__}, got "
                            f"{type(config).__name__}: build it with get_family({self.name!r}).config(...)")
        if self.requires is not None and importlib.util.find_spec(self.requires) is None:
            raise ValueError(MISSING_TRANSFORMERS)
        module, function = self.spec_factory.split(":")
        return getattr(importlib.import_module(module, __package__), function)(config)

    @property
    def supports_sequence_chunks(self) -> bool:
        """Whether its stages take `chunk=` (Seq1F1B): the built-in models do, Hugging Face's do not."""
        return self.requires is None


FAMILIES: Mapping[str, Family] = MappingProxyType({
    f.name: f for f in (
        Family("gpt", "GPT", GPTConfig, ".gpt:gpt_spec"),
        Family("llama", "Llama", LlamaConfig, ".llama:llama_spec"),
        Family("hf-llama", "Hugging Face Llama", LlamaConfig, ".hf_llama:hf_llama_spec", requires="transformers"),
    )
})


def family_names() -> tuple[str, ...]:
    return tuple(FAMILIES)


def get_family(name: str) -> Family:
    """The family called `name`; an unknown name, or hf-llama without transformers, is a ValueError."""
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown model family {name!r}: choose one of {', '.join(FAMILIES)}")
    if family.requires is not None and importlib.util.find_spec(family.requires) is None:
        raise ValueError(MISSING_TRANSFORMERS)
    return family
