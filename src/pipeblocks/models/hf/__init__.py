"""Hugging Face causal language models: a model directory trained as it is, and written back.

    >>> from pipeblocks.models.hf import hf_spec, save_hf
    >>> spec = hf_spec("path/to/model")          # config.json, safetensors weights, tokenizer files
    $ pipeblocks train --hf path/to/model --data notes.txt --save-hf out/

    adapter    HF_LAYOUT, HFDecoderAdapter: the decoder layers called as their model calls them
    tp         hf_tp_plan: Megatron's tensor parallelism by transformers' module names
    weights    SafetensorsWeights: each rank reads only its stages' tensors (or its TP slices)
    directory  hf_spec(DIR): the `ModelSpec` of a model directory (architectures: core.cost.hf_config.SUPPORTED)
    export     save_hf: config.json, safetensors (sharded above a size, with an index), tokenizer files

Nothing in a model directory is executed: weights come from safetensors only (a directory
with only pickled `pytorch_model.bin` is refused with the conversion command), and no
`trust_remote_code` model is loaded. transformers (and safetensors, which it brings) is an
optional extra: `pip install -e .[hf]`; importing this package does not import it.
"""
from __future__ import annotations

from ...core.util.lazy import lazy_exports

__all__ = ["HF_LAYOUT", "HFDecoderAdapter", "SafetensorsWeights", "hf_spec", "hf_tp_plan", "save_hf",
           "require_transformers"]

_HOME = {
    "HF_LAYOUT": "adapter", "HFDecoderAdapter": "adapter", "require_transformers": "adapter",
    "hf_tp_plan": "tp", "SafetensorsWeights": "weights", "hf_spec": "directory", "save_hf": "export",
}


__getattr__, __dir__ = lazy_exports(__name__, _HOME)
