"""Hugging Face `transformers.LlamaForCausalLM` of pipeblocks' own `LlamaConfig`, random weights.

    >>> from pipeblocks.models.hf_llama import build_hf_llama, hf_llama_spec
    >>> cfg = LlamaConfig(layers=4, hidden=64, heads=4, kv_heads=2, seq=64, vocab=256)
    >>> model = build_hf_llama(cfg)                  # HF's own model; nothing is downloaded
    >>> spec = hf_llama_spec(cfg)                    # `pipeblocks train --model-family hf-llama`
    >>> mine = build_stages(spec, seed=0, num_stages=4, stages=(0, 3))   # only these, weights from the seed

The model is built from the same size options as the built-in Llama, untied, without
dropout, with SDPA attention by default; its weights come from (seed, parameter name)
(`init.normal_init`). Its stages run as any Hugging Face decoder's (`models.hf`: the layout,
the adapter and the tensor-parallel plan). A model directory with its own weights is
`models.hf.hf_spec(DIR)` (`pipeblocks train --hf DIR`).

transformers is optional: importing this module does not import it; building a model or
stages without it raises one line saying how to install it.
"""
from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from .hf.adapter import HF_LAYOUT, MISSING_TRANSFORMERS, HFDecoderAdapter, require_transformers
from .hf.tp import hf_tp_plan
from .init import normal_init
from .llama_config import LlamaConfig
from .shapes import llama_shape
from .spec import HFExport, ModelSpec

__all__ = ["MISSING_TRANSFORMERS", "build_hf_llama", "hf_config", "hf_llama_spec", "llama_config_json", "llama_hf_name"]


def hf_config(cfg: LlamaConfig, *, attn_implementation: str = "sdpa") -> Any:
    """A `transformers.LlamaConfig` of cfg's shape: untied, no dropout, no biases."""
    tf = require_transformers()
    return tf.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.seq, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        attention_dropout=0.0, attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        use_cache=False, attn_implementation=attn_implementation,
    )


def build_hf_llama(cfg: LlamaConfig, *, seed: int | None = None, attn_implementation: str = "sdpa") -> nn.Module:
    """HF's LlamaForCausalLM of cfg's shape, in cfg's dtype; with `seed`, its weights from `normal_init`."""
    tf = require_transformers()
    model = tf.LlamaForCausalLM(hf_config(cfg, attn_implementation=attn_implementation)).to(cfg.torch_dtype)
    if seed is not None:
        init = normal_init(seed)
        for name, param in model.named_parameters():
            if not param.is_meta:
                init(name, param)
    return model


def hf_llama_spec(cfg: LlamaConfig, *, attn_implementation: str = "sdpa"):
    """HF's Llama of `cfg` as a `ModelSpec` (weights from the run's seed)."""
    require_transformers()
    return ModelSpec(name="hf-llama", title="Hugging Face Llama",
                     build=partial(build_hf_llama, cfg, attn_implementation=attn_implementation), layout=HF_LAYOUT,
                     shape=llama_shape(cfg), init=normal_init,
                     adapter=HFDecoderAdapter(attn_implementation), tp_plan=hf_tp_plan,
                     export=HFExport(config=partial(llama_config_json, cfg)))


def llama_config_json(cfg: LlamaConfig) -> dict:
    """config.json of transformers' LlamaForCausalLM of `cfg`'s shape (what `--save-hf` writes)."""
    config = hf_config(cfg).to_dict()
    config.update(architectures=["LlamaForCausalLM"], use_cache=True)
    config.pop("_attn_implementation_autoset", None)
    return config


_LLAMA_NAMES = (  # the built-in Llama's names -> transformers' LlamaForCausalLM's
    ("embed.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"), ("head.weight", "lm_head.weight"),
)
_BLOCK_NAMES = (
    ("attn_norm.", "input_layernorm."), ("mlp_norm.", "post_attention_layernorm."), ("attn.", "self_attn."),
    ("mlp.", "mlp."),
)


def llama_hf_name(name: str) -> str:
    """A parameter of the built-in Llama by its name in transformers' LlamaForCausalLM:
    "blocks.3.attn.q_proj.weight" -> "model.layers.3.self_attn.q_proj.weight"."""
    for ours, theirs in _LLAMA_NAMES:
        if name == ours:
            return theirs
    if name.startswith("blocks."):
        _, index, rest = name.split(".", 2)
        for ours, theirs in _BLOCK_NAMES:
            if rest.startswith(ours):
                return f"model.layers.{index}.{theirs}{rest[len(ours):]}"
    raise ValueError(f"the built-in Llama has no parameter {name!r} that LlamaForCausalLM names")
