"""The `ModelSpec` of a Hugging Face model directory: its architecture, shape and weights.

    >>> spec = hf_spec("path/to/qwen2")      # config.json + model.safetensors (or an index and shards)
    >>> spec.shape.layers, spec.shape.tied, spec.title
    (24, True, 'Qwen2ForCausalLM')
    >>> stages = build_stages(spec, num_stages=4, stages=(0, 3))   # reads only those stages' tensors

The architecture and the sizes come from config.json (`core.cost.hf_config.read_hf_config`,
which names the supported architectures and refuses the others); the model is built by
transformers' own class of that architecture from the directory's config (never remote
code), with SDPA attention, no K/V cache and no dropout (pipeblocks verifies exact
gradients, which dropout's random masks would not give). Its weights are the directory's
safetensors, read lazily per rank (`weights.SafetensorsWeights`), in the run's precision.
Positions and rotary tables are recomputed on every stage by the model's own rotary module.
"""
from __future__ import annotations

import os
from functools import partial

from ...core.cost.hf_config import FLOAT32_NORMS, HFConfig, read_hf_config
from ..init import normal_init
from ..spec import HFExport, ModelSpec
from .adapter import HF_LAYOUT, HFDecoderAdapter, require_transformers
from .tp import hf_tp_plan
from .weights import SafetensorsWeights

__all__ = ["hf_spec", "hf_model_config"]

_DROPOUTS = ("attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "attn_pdrop")


def hf_spec(directory: str | os.PathLike, *, attn_implementation: str = "sdpa", weights: bool = True) -> ModelSpec:
    """The model in `directory` (or of a config.json) with its own weights (bad directories are
    refused in one line). weights=False: the same model with weights drawn from the run's seed,
    for a prediction (`train --dry-run --hf config.json`) where there are none to read."""
    config = read_hf_config(directory)
    require_transformers()
    source = {"weights": SafetensorsWeights(config.directory)} if weights else {"init": normal_init}
    return ModelSpec(
        name=f"hf:{config.directory}", title=config.architecture,
        build=partial(_build, config, attn_implementation), layout=HF_LAYOUT, shape=config.shape, **source,
        adapter=HFDecoderAdapter(attn_implementation, config.sliding_window),
        tp_plan=partial(hf_tp_plan, qk_norm=config.shape.qk_norm),
        export=HFExport(config=lambda: dict(config.raw), files_from=config.directory),
        float32_norms=config.architecture in FLOAT32_NORMS,
    )


def hf_model_config(config: HFConfig, attn_implementation: str = "sdpa"):
    """transformers' config object of the directory, as pipeblocks runs it (no cache, no dropout)."""
    tf = require_transformers()
    model_class = getattr(tf, config.architecture)
    hf = model_class.config_class.from_pretrained(config.directory, trust_remote_code=False)
    hf.use_cache = False
    hf._attn_implementation = attn_implementation
    for name in _DROPOUTS:
        if getattr(hf, name, 0.0):
            setattr(hf, name, 0.0)
    return hf


def _build(config: HFConfig, attn_implementation: str):
    tf = require_transformers()
    return getattr(tf, config.architecture)(hf_model_config(config, attn_implementation))
