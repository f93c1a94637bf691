"""Models and their split into pipeline stages: the `ModelSpec` every model is trained through,
the splitter for any model with a block list, the built-in models, and Hugging Face models.

    spec        ModelSpec, ModelShape, register_model, load_spec       (what `train` needs from a model)
    build       build_stages, build_model, split_stages, spec_of      (one path for every spec)
    splitter    Layout, split_model, allocate_stages, Stage, BlockAdapter, TiedPair   (bring your own model)
    gpt         GPTConfig, GPT, gpt_spec                               (the reference GPT)
    llama       LlamaConfig, Llama, llama_spec                         (the built-in Llama-style model)
    hf          pipeblocks.models.hf: hf_spec(DIR), save_hf            (Hugging Face directories; transformers)
    families    get_family("gpt" | "llama" | "hf-llama"), family_names()

Names are imported on first use, so `from pipeblocks.models import GPTConfig` (and
LlamaConfig, Layout, ModelShape, get_family, and the command line) does not import torch;
`GPT`, `build_stages`, `split_model` and the rest do. Nothing here imports transformers.
"""
from __future__ import annotations

from ..core.util.lazy import lazy_exports

__all__ = [
    "ModelSpec", "ModelShape", "register_model", "load_spec", "model_logits",
    "build_stages", "build_model", "split_stages", "spec_of",
    "GPTConfig", "GPT", "causal_attention", "cross_entropy", "gpt_spec", "layer_counts", "layer_ranges",
    "LlamaConfig", "Llama", "llama_spec",
    "Layout", "Stage", "TiedPair", "BlockAdapter", "split_model", "allocate_stages",
    "Family", "get_family", "family_names",
]

_HOME = {
    "ModelSpec": "spec", "register_model": "spec", "load_spec": "spec", "model_logits": "spec",
    "ModelShape": "..core.cost.model_shape",
    "build_stages": "build", "build_model": "build", "split_stages": "build", "spec_of": "build",
    "GPTConfig": "config", "GPT": "gpt", "causal_attention": "gpt", "cross_entropy": "spec", "gpt_spec": "gpt",
    "layer_counts": "..core.cost.split", "layer_ranges": "layout",
    "LlamaConfig": "llama_config", "Llama": "llama", "llama_spec": "llama",
    "Layout": "layout", "Stage": "stage", "TiedPair": "stage", "BlockAdapter": "adapter", "split_model": "splitter",
    "allocate_stages": "splitter",
    "Family": "family", "get_family": "family", "family_names": "family",
}


__getattr__, __dir__ = lazy_exports(__name__, _HOME)
