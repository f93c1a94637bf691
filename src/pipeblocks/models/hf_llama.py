"""Hugging Face `transformers.LlamaForCausalLM` through the splitter: an adapter and a layout.

    >>> from pipeblocks.models.hf_llama import build_hf_llama, build_hf_llama_stages, split_hf_llama
    >>> cfg = LlamaConfig(layers=4, hidden=64, heads=4, kv_heads=2, seq=64, vocab=256)
    >>> model = build_hf_llama(cfg, seed=0)      # random weights from the seed; nothing is downloaded
    >>> logits = model(tokens)                   # HF's own forward, returning the logits tensor
    >>> stages = split_hf_llama(model, 2)        # sharing model's parameters
    >>> mine = build_hf_llama_stages(cfg, seed=0, num_stages=4, stages=(0, 3))   # only these

The model is built from pipeblocks' own `LlamaConfig` (the same size options as the built-in
Llama), untied, without dropout, with SDPA attention by default. Its parts by path:

    before   model.embed_tokens
    blocks   model.layers                (LlamaDecoderLayer)
    after    model.norm, lm_head
    shared   model.rotary_emb            (every stage recomputes cos/sin for its positions)

Each stage calls its decoder layers as `LlamaModel.forward` does: with
`position_embeddings=(cos, sin)`, `position_ids`, and the causal mask, which is None under
SDPA (its causal flag) and an additive mask under "eager". A layer that returns a tuple
(transformers 4.x) gives its first element. HF attention has no seam for the K/V of
earlier sequence chunks, so these stages refuse `chunk=` (Seq1F1B).

transformers is optional: importing this module does not import it; building a model or
stages without it raises one line saying how to install it.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import Tensor, nn

from .adapter import BlockAdapter, SequenceChunkLike
from .family import MISSING_TRANSFORMERS
from .init import seeded_normal_
from .layout import Layout, block_ranges
from .llama_config import LlamaConfig
from .splitter import allocate_stages, split_model
from .stage import Stage

__all__ = [
    "HF_LLAMA_LAYOUT", "HFLlamaAdapter", "MISSING_TRANSFORMERS", "require_transformers", "hf_config",
    "build_hf_llama", "parameter_init", "split_hf_llama", "build_hf_llama_stages", "hf_llama_tp_plan",
]

HF_LLAMA_LAYOUT = Layout(
    blocks="model.layers", before=("model.embed_tokens",), after=("model.norm", "lm_head"),
    shared=("model.rotary_emb",),
)


def require_transformers() -> Any:
    """The transformers module, or a one-line ValueError saying how to install it."""
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(MISSING_TRANSFORMERS)
    return importlib.import_module("transformers")


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


def build_hf_llama(cfg: LlamaConfig, *, seed: int, attn_implementation: str = "sdpa") -> nn.Module:
    """The whole HF model, weights from `parameter_init`; `model(tokens)` returns the logits tensor."""
    tf = require_transformers()

    class LlamaLogits(tf.LlamaForCausalLM):
        """LlamaForCausalLM whose forward takes token ids and returns logits [b, s, vocab]."""

        def forward(self, input_ids: Tensor) -> Tensor:  # type: ignore[override]
            return super().forward(input_ids=input_ids, use_cache=False).logits

    model = LlamaLogits(hf_config(cfg, attn_implementation=attn_implementation)).to(cfg.torch_dtype)
    init = parameter_init(cfg, seed=seed)
    for name, param in model.named_parameters():
        if not param.is_meta:  # a skeleton the splitter builds is filled per stage
            init(name, param)
    return model


def parameter_init(cfg: LlamaConfig, *, seed: int) -> Callable[[str, Tensor], None]:
    """`init(name, tensor)` from (seed, the HF name): norms one, every other weight N(0, 0.02) (HF's range)."""

    def init(name: str, param: Tensor) -> None:
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                seeded_normal_(param, seed=seed, name=name, std=0.02)

    return init


class _Context(NamedTuple):
    position_ids: Tensor
    position_embeddings: tuple[Tensor, Tensor]
    mask: Tensor | None


class HFLlamaAdapter(BlockAdapter):
    """Calls HF decoder layers with the rotary cos/sin, positions and causal mask of its stage."""

    supports_sequence_chunks = False

    def __init__(self, attn_implementation: str = "sdpa") -> None:
        self.attn_implementation = attn_implementation

    def context(self, stage: Stage, h: Tensor, chunk: SequenceChunkLike | None) -> _Context:
        s = h.size(1)
        position_ids = torch.arange(s, device=h.device).unsqueeze(0)
        cos, sin = stage.part("model.rotary_emb")(h, position_ids)
        mask = None
        if self.attn_implementation != "sdpa":  # SDPA applies causality by itself when the mask is None
            blocked = torch.ones(s, s, dtype=torch.bool, device=h.device).triu(1)
            mask = torch.zeros(s, s, dtype=h.dtype, device=h.device).masked_fill(blocked, torch.finfo(h.dtype).min)
            mask = mask[None, None]
        return _Context(position_ids, (cos, sin), mask)

    def run_block(self, name: str, block: nn.Module, h: Tensor, ctx: _Context) -> Tensor:
        out = block(h, attention_mask=ctx.mask, position_ids=ctx.position_ids,
                    position_embeddings=ctx.position_embeddings)
        return out[0] if isinstance(out, tuple) else out

    def __repr__(self) -> str:
        return f"HFLlamaAdapter(attn_implementation={self.attn_implementation!r})"


def split_hf_llama(model: nn.Module, num_stages: int, *, counts: Sequence[int] | None = None) -> list[Stage]:
    """All stages of an HF Llama model, sharing its parameters."""
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    return split_model(model, HF_LLAMA_LAYOUT, num_stages, adapter=HFLlamaAdapter(attn), counts=counts)


def build_hf_llama_stages(
    cfg: LlamaConfig,
    *,
    seed: int,
    num_stages: int,
    stages: Sequence[int],
    counts: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str = "sdpa",
) -> list[Stage]:
    """Build only the listed stages, with the weights `build_hf_llama(cfg, seed=seed)` has."""
    require_transformers()
    block_ranges(cfg.layers, num_stages, counts)  # the config's errors before any module is built
    return allocate_stages(
        lambda: build_hf_llama(cfg, seed=seed, attn_implementation=attn_implementation), HF_LLAMA_LAYOUT,
        num_stages=num_stages, stages=stages, device=device, init=parameter_init(cfg, seed=seed),
        adapter=HFLlamaAdapter(attn_implementation), counts=counts,
    )


def hf_llama_tp_plan():
    """Hugging Face Llama's tensor-parallel plan (`models.tp_plan`), the built-in Llama's by
    HF's module names; the decoder layer calls its attention with keyword arguments."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    from .tp_plan import TPPlan

    block = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                        use_local_output=True),
        **{f"self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    first = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                   use_local_output=False)}
    last = {"model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    return TPPlan(block=block, first=first, last=last)
