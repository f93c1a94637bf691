"""The built-in models' sizes as the simulator, the memory model and the tensor-parallel
checks read them: a `ModelShape` of each family's config, without torch."""
from __future__ import annotations

from ..core.cost.model_shape import ModelShape
from .config import GPTConfig
from .llama_config import LlamaConfig

__all__ = ["gpt_shape", "llama_shape"]


def gpt_shape(cfg: GPTConfig) -> ModelShape:
    """The reference GPT's sizes as the simulator reads them."""
    return ModelShape(layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, vocab=cfg.vocab,
                      ffn=cfg.mlp_ratio * cfg.hidden, context=cfg.seq)


def llama_shape(cfg: LlamaConfig) -> ModelShape:
    """The Llama-style model's sizes as the simulator reads them (Hugging Face's Llama of the
    same config has the same)."""
    return ModelShape(layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, vocab=cfg.vocab, kv_heads=cfg.kv_heads,
                      ffn=cfg.intermediate_size, mlp="swiglu", norm="rmsnorm", positions="rotary", context=cfg.seq,
                      linear_bias=False)
