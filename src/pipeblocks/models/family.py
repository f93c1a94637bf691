"""Model families by name: one entry point for the training loop, the reference and the CLI.

    >>> fam = get_family("llama")                  # "gpt", "llama" or "hf-llama"
    >>> cfg = fam.config(layers=8, hidden=64, heads=4, kv_heads=2, seq=64, vocab=256, dtype="float32")
    >>> fam.describe(cfg)
    '8-layer Llama (hidden 64, 4 heads, 2 KV heads)'
    >>> reference = fam.build_model(cfg, seed=0)                       # the whole model, one process
    >>> mine = fam.build_stages(cfg, seed=0, num_stages=4, stages=(0, 3), device="cpu")  # one rank's
    >>> stages = fam.split(reference, 4)                               # all stages, shared parameters
    >>> loss = fam.loss_fn(logits, targets)        # mean next-token cross entropy, float32 or wider
    >>> plan = fam.tp_plan()                       # how a stage splits over tensor-parallel ranks (tp_plan.py)

Families:
    gpt        the reference GPT (learned positions, LayerNorm, GELU MLP); GPTConfig
    llama      the built-in Llama-style model (RMSNorm, rotary, SwiGLU, grouped-query attention); LlamaConfig
    hf-llama   Hugging Face transformers' LlamaForCausalLM of the same LlamaConfig (needs transformers)

Importing this module imports neither torch nor transformers; the builders import them on
first use. Asking for hf-llama without transformers is a one-line ValueError.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from .config import GPTConfig
from .llama_config import LlamaConfig

__all__ = ["Family", "FAMILIES", "MISSING_TRANSFORMERS", "get_family", "family_names"]

MISSING_TRANSFORMERS = "--model-family hf-llama needs transformers: pip install -e .[hf] (or pip install transformers)"


@dataclass(frozen=True)
class Family:
    """A model family: its config type and where its builders live ("module:function", imported on use)."""

    name: str
    title: str
    """What `describe` calls the model: "GPT", "Llama", "Hugging Face Llama"."""
    config_type: type
    model_builder: str
    """`f(config, seed=...)` -> the whole model, whose forward maps token ids to logits."""
    stages_builder: str
    """`f(config, seed=, num_stages=, stages=, counts=, device=)` -> only those stages."""
    splitter: str
    """`f(model, num_stages, counts=)` -> every stage, sharing the model's parameters."""
    supports_sequence_chunks: bool
    """Whether its stages take `chunk=` (Seq1F1B and the other sequence-chunked schedules)."""
    tp_planner: str
    """`f()` -> its `tp_plan.TPPlan`: how a stage is split over tensor-parallel ranks."""
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

    def build_model(self, config: Any, seed: int = 0) -> Any:
        """The whole model with the weights of `seed`: the one-process reference."""
        return self._resolve(self.model_builder)(self._checked(config), seed=seed)

    def build_stages(self, config: Any, *, seed: int, num_stages: int, stages: Sequence[int], device: Any = None,
                     counts: Sequence[int] | None = None) -> list:
        """Only the stages listed (global indices), with the weights `build_model(config, seed)` has."""
        return self._resolve(self.stages_builder)(self._checked(config), seed=seed, num_stages=num_stages,
                                                  stages=stages, counts=counts, device=device)

    def split(self, model: Any, num_stages: int, *, counts: Sequence[int] | None = None) -> list:
        """All stages of `model` (from `build_model`), sharing its parameters."""
        return self._resolve(self.splitter)(model, num_stages, counts=counts)

    def tp_plan(self) -> Any:
        """The `tp_plan.TPPlan` that `runtime.tensor_parallel.parallelize_stage` applies to its stages."""
        return self._resolve(self.tp_planner)()

    @staticmethod
    def loss_fn(logits: Any, targets: Any) -> Any:
        """Mean next-token cross entropy over [b, s, V] logits, computed in float32 or wider."""
        from .gpt import cross_entropy

        return cross_entropy(logits, targets)

    def describe(self, config: Any) -> str:
        """A short line for progress output: '8-layer Llama (hidden 64, 4 heads, 2 KV heads)'."""
        config = self._checked(config)
        heads = f"{config.heads} heads"
        if isinstance(config, LlamaConfig):
            heads += f", {config.num_kv_heads} KV heads"
        return f"{config.layers}-layer {self.title} (hidden {config.hidden}, {heads})"

    def _checked(self, config: Any) -> Any:
        if not isinstance(config, self.config_type):
            raise TypeError(f"the {self.name} family takes a {self.config_type.__name__}, got "
                            f"{type(config).__name__}: build it with get_family({self.name!r}).config(...)")
        return config

    def _resolve(self, target: str) -> Any:
        if self.requires is not None and importlib.util.find_spec(self.requires) is None:
            raise ValueError(MISSING_TRANSFORMERS)
        module, function = target.split(":")
        return getattr(importlib.import_module(module, __package__), function)


FAMILIES: Mapping[str, Family] = MappingProxyType({
    f.name: f for f in (
        Family("gpt", "GPT", GPTConfig, ".gpt:GPT", ".split:build_stages", ".split:split_gpt", True,
               ".gpt:gpt_tp_plan"),
        Family("llama", "Llama", LlamaConfig, ".llama:Llama", ".llama:build_llama_stages", ".llama:split_llama",
               True, ".llama:llama_tp_plan"),
        Family("hf-llama", "Hugging Face Llama", LlamaConfig, ".hf_llama:build_hf_llama",
               ".hf_llama:build_hf_llama_stages", ".hf_llama:split_hf_llama", False, ".hf_llama:hf_llama_tp_plan",
               requires="transformers"),
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
