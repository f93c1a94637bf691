"""The reference GPT and its split into pipeline stages (torch enters here)."""
from .gpt import GPT, GPTConfig, causal_attention, cross_entropy
from .split import GPTStage, build_stages, layer_counts, layer_ranges, split_gpt

__all__ = [
    "GPT", "GPTConfig", "causal_attention", "cross_entropy",
    "GPTStage", "build_stages", "layer_counts", "layer_ranges", "split_gpt",
]
