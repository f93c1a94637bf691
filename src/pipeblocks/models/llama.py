"""A Llama-style decoder, and its split into pipeline stages.

    >>> from pipeblocks.models import build_stages, split_stages
    >>> from pipeblocks.models.llama import Llama, llama_spec
    >>> from pipeblocks.models.llama_config import LlamaConfig
    >>> cfg = LlamaConfig(layers=4, hidden=64, heads=4, kv_heads=2, seq=64, vocab=256, dtype="float64")
    >>> model = Llama(cfg, seed=0)                    # the same seed gives the same weights, everywhere
    >>> logits = model(torch.zeros(2, 64, dtype=torch.long))               # [2, 64, 256]
    >>> stages = split_stages(cfg, model, 2)                               # sharing model's parameters
    >>> mine = build_stages(cfg, seed=0, num_stages=4, stages=(0, 3))      # only these, same weights
    >>> spec = llama_spec(cfg)                        # the model as `pipeblocks train` sees it

Layout (parameter names in brackets; the stages use the same names)::

    token ids [b, s]
      -> Embedding                                                  [embed.weight]
      -> Block x layers: x + attn(attn_norm(x)); x + mlp(mlp_norm(x))  [blocks.<i>.*]
           attention: q, k, v projections, rotary positions on q and k, grouped-query
           causal SDPA (kv_heads K/V heads shared by heads / kv_heads query heads), o_proj
           mlp: SwiGLU, down(silu(gate(x)) * up(x))
      -> RMSNorm, linear to vocab (untied)                          [norm.weight, head.weight]
    logits [b, s, vocab]

The rotary table (`rotary`, a parameter-free module whose frequencies are a non-persistent
buffer) is shared: every stage holds its own and computes cos/sin for its positions, so
only the hidden state crosses between stages. No projection has a bias.

Initialisation is a function of (seed, parameter name): weights N(0, 0.02), the residual
projections (o_proj, down_proj) scaled by 1/sqrt(2·layers), norms one.

Sequence chunks (Seq1F1B) as in the GPT: `stage(x, chunk=c)` puts the rotary positions at
c.offset and gives each block's attention the extender `c.kv("blocks.<i>")`, which returns
the keys and values of this and earlier chunks (kv_heads heads) and the causal mask.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .adapter import BlockAdapter, KVExtenderLike, SequenceChunkLike
from .hf_llama import llama_config_json, llama_hf_name
from .init import normal_init
from .layout import Layout
from .llama_config import LlamaConfig
from .shapes import llama_shape
from .spec import HFExport, ModelSpec, cross_entropy
from .stage import Stage
from .tp_plan import TPPlan

__all__ = [
    "LlamaConfig", "Llama", "LlamaBlock", "Attention", "SwiGLU", "Rotary", "apply_rotary",
    "LLAMA_LAYOUT", "LlamaAdapter", "parameter_init", "llama_spec", "llama_tp_plan",
]

LLAMA_LAYOUT = Layout(blocks="blocks", before=("embed",), after=("norm", "head"), shared=("rotary",))


class Rotary(nn.Module):
    """cos and sin of the rotary angles, [length, head_dim], for positions offset..offset+length-1."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.context = cfg.seq
        d = cfg.head_dim
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, offset: int, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if offset + length > self.context:
            raise ValueError(
                f"positions {offset}..{offset + length - 1} exceed the model's context of {self.context}: "
                "use shorter sequences or a larger LlamaConfig.seq"
            )
        positions = torch.arange(offset, offset + length, dtype=torch.float64, device=self.inv_freq.device)
        angles = torch.outer(positions, self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # the two halves of a head rotate as pairs (i, i + d/2)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [b, a, s, d] by the angles of its positions (rotate-half convention)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.num_kv_heads, cfg.head_dim
        dt = cfg.torch_dtype
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False, dtype=dt)
        self.k_proj = nn.Linear(cfg.hidden, self.kv_heads * cfg.head_dim, bias=False, dtype=dt)
        self.v_proj = nn.Linear(cfg.hidden, self.kv_heads * cfg.head_dim, bias=False, dtype=dt)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False, dtype=dt)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: KVExtenderLike | None = None) -> Tensor:
        b, s, _ = x.shape
        # heads counted from the projections' widths: under tensor parallelism they hold a shard of the heads
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        grouped = self.kv_heads != self.heads
        if kv is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        else:
            k, v, mask = kv.extend(k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        dt, inner = cfg.torch_dtype, cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden, inner, bias=False, dtype=dt)
        self.up_proj = nn.Linear(cfg.hidden, inner, bias=False, dtype=dt)
        self.down_proj = nn.Linear(inner, cfg.hidden, bias=False, dtype=dt)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder block."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps, dtype=cfg.torch_dtype)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps, dtype=cfg.torch_dtype)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: KVExtenderLike | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, kv)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """The whole model in one module: what one process trains as the reference."""

    def __init__(self, cfg: LlamaConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, dtype=cfg.torch_dtype)
        self.rotary = Rotary(cfg)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps, dtype=cfg.torch_dtype)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, dtype=cfg.torch_dtype)
        init = parameter_init(cfg, seed=seed)
        for name, param in self.named_parameters():
            if not param.is_meta:  # a skeleton the splitter builds is filled per stage
                init(name, param)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        cos, sin = self.rotary(0, idx.size(1), x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def parameter_init(cfg: LlamaConfig, *, seed: int) -> Callable[[str, Tensor], None]:
    """`init(name, tensor)`: fill one parameter from (seed, its full-model name)."""
    residual_std = 0.02 / math.sqrt(2 * cfg.layers)
    return normal_init(seed, residual=("o_proj.weight", "down_proj.weight"), residual_std=residual_std)


class _Context(NamedTuple):
    cos: Tensor
    sin: Tensor
    chunk: SequenceChunkLike | None


class LlamaAdapter(BlockAdapter):
    """Each stage computes the rotary cos/sin of its tokens' positions; blocks take them and the chunk's K/V."""

    supports_sequence_chunks = True

    def context(self, stage: Stage, h: Tensor, chunk: SequenceChunkLike | None) -> _Context:
        offset = chunk.offset if chunk is not None else 0
        cos, sin = stage.part("rotary")(offset, h.size(1), h.dtype)
        return _Context(cos, sin, chunk)

    def run_block(self, name: str, block: nn.Module, h: Tensor, ctx: _Context) -> Tensor:
        return block(h, ctx.cos, ctx.sin, ctx.chunk.kv(name) if ctx.chunk is not None else None)


def llama_spec(cfg: LlamaConfig):
    """The built-in Llama-style model of `cfg` as a `ModelSpec` (weights from the run's seed)."""
    return ModelSpec(name="llama", title="Llama", build=lambda: Llama(cfg, seed=0), layout=LLAMA_LAYOUT,
                     shape=llama_shape(cfg), init=lambda seed: parameter_init(cfg, seed=seed), adapter=LlamaAdapter(),
                     loss=cross_entropy, tp_plan=llama_tp_plan,
                     export=HFExport(config=partial(llama_config_json, cfg), rename=llama_hf_name))


def llama_tp_plan():
    """The Llama-style model's tensor-parallel plan (`models.tp_plan`): q, k, v, gate and up
    split by columns (heads, KV heads, inner features), o_proj and down_proj by rows; the
    embedding by vocabulary rows, the head by vocabulary columns; RMSNorms on the token shard."""
    from torch.distributed.tensor import Replicate, Shard  # DTensor takes 0.4 s to import: loaded only for a tensor-parallel run
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    block = {
        "attn_norm": SequenceParallel(),
        # attn(x, cos, sin, kv): only x is sharded; the rotary tables are whole on every rank
        "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                   desired_input_layouts=(Replicate(), None, None, None), use_local_output=True),
        **{f"attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")},
        "attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    first = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)}
    last = {"norm": SequenceParallel(), "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    return TPPlan(block=block, first=first, last=last)
