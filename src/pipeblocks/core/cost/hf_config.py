"""A Hugging Face model directory's config.json, read without torch or transformers.

    >>> config = read_hf_config("path/to/model")          # a directory, or its config.json
    >>> config.architecture, config.shape.layers, config.shape.kv_heads
    ('LlamaForCausalLM', 32, 8)

The simulator and the planner price a model from this alone (`--hf DIR|config.json`), and
`pipeblocks train --hf DIR` checks it before any process starts. The architectures
pipeblocks trains are those of `SUPPORTED`; each is a decoder whose blocks run RMSNorm,
rotary attention (grouped-query where num_key_value_heads < num_attention_heads) and a
gated MLP (SwiGLU, or Gemma's GeGLU: three projections either way).

What is read, by the config's own key names: num_hidden_layers, hidden_size,
num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab_size,
tie_word_embeddings, max_position_embeddings, rms_norm_eps, the rope base (rope_theta, or
rope_parameters["rope_theta"] in transformers 5), attention_bias / mlp_bias (Llama),
sliding_window and use_sliding_window (Mistral, Qwen2), torch_dtype / dtype. A key that an
architecture's transformers config defaults is given that default when absent.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from .model_shape import ModelShape

__all__ = ["FLOAT32_NORMS", "SUPPORTED", "HFConfig", "config_path", "read_hf_config", "supported_text"]

# architecture -> (tie_word_embeddings default, q/k/v biases always, q/k norms, rope base default)
_ARCHITECTURES: Mapping[str, tuple[bool, bool, bool, float]] = MappingProxyType({
    "LlamaForCausalLM": (False, False, False, 10000.0),
    "MistralForCausalLM": (False, False, False, 10000.0),
    "Qwen2ForCausalLM": (False, True, False, 10000.0),
    "Qwen3ForCausalLM": (False, False, True, 10000.0),
    "GemmaForCausalLM": (True, False, False, 10000.0),
})
SUPPORTED = tuple(_ARCHITECTURES)
"""The architectures (config.json's "architectures") `pipeblocks train --hf` trains."""
FLOAT32_NORMS = frozenset({"GemmaForCausalLM"})
"""Architectures whose RMSNorm computes in float32 whatever the model's dtype (transformers' own)."""


def supported_text() -> str:
    return ", ".join(SUPPORTED)


@dataclass(frozen=True)
class HFConfig:
    """What pipeblocks reads of a config.json."""

    path: str
    """the config.json read"""
    architecture: str
    model_type: str
    shape: ModelShape
    rope_theta: float
    norm_eps: float
    sliding_window: int | None
    """attention sees only this many earlier tokens (None: every earlier token)"""
    dtype: str | None
    """the dtype the weights were saved in, as config.json names it (None: not said)"""
    raw: Mapping[str, Any]
    """the whole config.json, as read"""

    @property
    def directory(self) -> str:
        return str(Path(self.path).parent)

    def describe(self) -> str:
        return f"{self.architecture} ({self.shape.describe()})"


def config_path(path: str | os.PathLike) -> Path:
    """config.json itself: `path` when it names a file, else the file of that name in the directory `path`."""
    given = Path(path)
    if given.is_dir():
        found = given / "config.json"
        if not found.is_file():
            raise ValueError(f"{str(path)!r} holds no config.json: give a Hugging Face model directory (config.json, "
                             "safetensors weights, tokenizer files), e.g. one written by save_pretrained")
        return found
    if given.is_file():
        return given
    raise ValueError(f"{str(path)!r} does not exist: give a Hugging Face model directory or its config.json")


def read_hf_config(path: str | os.PathLike) -> HFConfig:
    """The config of the model directory (or config.json) `path`; an architecture pipeblocks does not
    train, or a config without the sizes, is a ValueError naming what is wrong and the fix."""
    file = config_path(path)
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {str(file)!r} as JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{str(file)!r} is not a JSON object: expected a Hugging Face config.json")
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if isinstance(architectures, list) and architectures else None
    if architecture not in _ARCHITECTURES:
        named = f"architecture {architecture!r}" if architecture else "no architecture (config.json lacks 'architectures')"
        raise ValueError(
            f"{str(file)!r} names {named}: pipeblocks trains {supported_text()}; for another model, write a ModelSpec "
            "(docs/your-model.md) and train it with --model FILE.py:NAME"
        )
    tied_default, qkv_bias, qk_norm, theta_default = _ARCHITECTURES[architecture]

    def size(key: str, default: int | None = None) -> int:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{str(file)!r}: {key} must be an integer >= 1, got {value!r}")
        return value

    heads = size("num_attention_heads")
    hidden = size("hidden_size")
    head_dim = raw.get("head_dim")
    head_dim = size("head_dim") if head_dim is not None else None
    if head_dim is None and hidden % heads:
        raise ValueError(f"{str(file)!r}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}, "
                         "and no head_dim is given")
    linear_bias = bool(raw.get("attention_bias", False)) and bool(raw.get("mlp_bias", False))
    shape = ModelShape(
        layers=size("num_hidden_layers"), hidden=hidden, heads=heads, vocab=size("vocab_size"),
        kv_heads=size("num_key_value_heads", heads), head_dim=head_dim if head_dim != hidden // heads else None,
        ffn=size("intermediate_size"), mlp="swiglu", norm="rmsnorm", positions="rotary",
        context=size("max_position_embeddings", 2048), tied=bool(raw.get("tie_word_embeddings", tied_default)),
        linear_bias=linear_bias, qkv_bias=qkv_bias or (not linear_bias and bool(raw.get("attention_bias", False))),
        qk_norm=qk_norm,
    )
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    theta = _positive(file, "rope_theta", raw.get("rope_theta", rope.get("rope_theta", theta_default)))
    eps = _positive(file, "rms_norm_eps", raw.get("rms_norm_eps", 1e-6))
    window = raw.get("sliding_window")
    if architecture == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        window = None
    if window is not None:
        window = size("sliding_window")
    dtype = raw.get("torch_dtype", raw.get("dtype"))
    return HFConfig(str(file), architecture, str(raw.get("model_type", "")), shape, theta, eps, window,
                    dtype if isinstance(dtype, str) else None, MappingProxyType(raw))


def _positive(file: Path, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{str(file)!r}: {key} must be a finite number > 0, got {value!r}")
    return float(value)
