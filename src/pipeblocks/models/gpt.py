"""A small GPT-style decoder: the reference model that pipeblocks trains and checks against.

    >>> from pipeblocks.models import GPT, GPTConfig
    >>> import torch
    >>> cfg = GPTConfig(layers=4, hidden=64, heads=4, seq=64, vocab=256, dtype="float64")
    >>> model = GPT(cfg, seed=0)              # the same seed gives the same weights, everywhere
    >>> logits = model(torch.zeros(2, 64, dtype=torch.long))    # [2, 64, 256]

Layout (parameter names in brackets; a stage module uses the same names, so the union of
the stages' state dicts is the full model's state dict)::

    token ids [b, s]
      -> Embedding: token + learned position           [embed.tok, embed.pos]
      -> Block x layers: x + attn(ln1(x)); x + mlp(ln2(x))   [blocks.<i>.*]
      -> Head: final LayerNorm, linear to vocab (no tying) [head.norm, head.out]
    logits [b, s, vocab]

The LM head is not tied to the token embedding: the embedding lives on the first pipeline
stage and the head on the last, and tying would make them share a parameter across ranks.

Initialisation is a function of (seed, parameter name) alone (see `init_parameters`), so a
pipeline rank can build just its own stages (`pipeblocks.models.build_stages(gpt_spec(cfg),
...)`) and get exactly the weights that the whole model built from the same seed has
(`parameter_init` is the same rule as an `init(name, tensor)` function, the form the
splitter takes). `gpt_spec(cfg)` is the model as `pipeblocks train` sees it (`ModelSpec`).

Stages: stage s holds the s-th contiguous slice of blocks (`core.cost.split.layer_counts`: the
end stages, which carry the embedding and the head, get the lighter share); stage 0 also
the embedding and the last stage the head, by GPT_LAYOUT. Sequence chunks (Seq1F1B):
`stage(x, chunk=c)` runs the tokens [c.offset, c.offset + c.length) of a microbatch:
positions start at c.offset and every block's attention takes its K/V over the earlier
chunks from `c.kv("blocks.<i>")` (`pipeblocks.runtime.sequence.SequenceChunk`).

Attention. `torch.nn.functional.scaled_dot_product_attention` (SDPA): on CPU it runs the
flash kernel for float32 and float64 alike, which saves q, k, v, the output and one
log-sum-exp per query and head for the backward, not the s x s probabilities.

Attention seam for sequence-chunked schedules (Seq1F1B, Sun et al. 2024): the embedding
takes a position `offset`, and `CausalSelfAttention.forward` takes an optional `kv` object
whose `extend(k, v)` returns the keys and values to attend over (this chunk's and earlier
chunks', in the extender's order) with the causal mask for that order. The runtime's K/V
cache (`pipeblocks.runtime.sequence`) implements `extend` with one K/V buffer per
microbatch and hands the gradients of earlier chunks' K/V back; `GPTStage.forward(x,
chunk=...)` (split.py) wires the offset and one extender per block.
"""
from __future__ import annotations

import math
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .adapter import BlockAdapter
from .config import GPTConfig
from .init import seeded_normal_
from .layout import Layout
from .shapes import gpt_shape
from .spec import ModelSpec, cross_entropy
from .tp_plan import TPPlan

__all__ = [
    "GPTConfig", "GPT", "Embedding", "Block", "Head", "CausalSelfAttention", "MLP", "KVExtender", "GPT_LAYOUT",
    "GPTAdapter", "causal_attention", "bottom_right_mask", "init_parameters", "parameter_init",
    "gpt_spec", "gpt_tp_plan",
]

GPT_LAYOUT = Layout(blocks="blocks", before=("embed",), after=("head",))


class KVExtender(Protocol):
    """What a sequence-chunk schedule passes to attention.

    `extend(k, v)` receives this chunk's keys and values, [b, a, s_chunk, d], and returns
    (keys, values, mask): the keys and values of all positions 0..offset + s_chunk - 1,
    [b, a, offset + s_chunk, d], in an order of the extender's choosing, and the additive
    causal mask [s_chunk, offset + s_chunk] for that order (query i at position offset + i
    sees the keys at positions 0..offset + i).
    """

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]: ...


def causal_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax(q kᵀ/√d) v under a causal mask aligned bottom-right.

    q is [b, a, s_q, d]; k and v are [b, a, s_k, d] with s_k >= s_q. Query i sits at absolute
    position s_k - s_q + i and sees keys 0..s_k - s_q + i; with s_k == s_q this is the usual
    causal mask. (A top-left `is_causal` would be wrong when s_k > s_q.) `mask`: that mask,
    already built (`bottom_right_mask`), to share one tensor among layers.
    """
    s_q, s_k = q.size(-2), k.size(-2)
    if s_k == s_q:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if s_k < s_q:
        raise ValueError(f"attention over {s_k} keys for {s_q} queries: keys must include the queries' own positions")
    if mask is None:
        mask = bottom_right_mask(s_q, s_k, q.dtype, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def bottom_right_mask(s_q: int, s_k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive mask [s_q, s_k]: 0 where query i (at position s_k - s_q + i) may see key j, else -inf."""
    allowed = torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril(diagonal=s_k - s_q)
    return torch.zeros(s_q, s_k, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused q/k/v projection.

    The fused projection's 3·hidden outputs are grouped by head: head i's query, key and
    value (head_dim each) are outputs [3·d·i, 3·d·(i+1)), Megatron's layout. A row split of
    the fused weight is then a split by heads, which is what tensor parallelism shards
    (`gpt_tp_plan`); the forward counts heads from the projection's width, so it runs on
    a shard unchanged.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, dtype=cfg.torch_dtype)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, dtype=cfg.torch_dtype)

    def forward(self, x: Tensor, kv: KVExtender | None = None) -> Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv(x).view(b, s, -1, 3 * d).split(d, dim=3)  # [b, s, a, d] each
        if kv is not None:
            # k and v will live in the extender's buffer; q is a view of the fused qkv output,
            # and attention saving that view would keep this chunk's k and v a second time.
            # (Copied before the head transpose, so that the attention output keeps the
            # [b, s, a, d] layout and the projection's input stays a view of it.)
            q = q.contiguous()
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if kv is None:
            y = causal_attention(q, k, v)
        else:
            k, v, mask = kv.extend(k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden, dtype=cfg.torch_dtype)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden, dtype=cfg.torch_dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden, dtype=cfg.torch_dtype)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden, dtype=cfg.torch_dtype)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, kv: KVExtender | None = None) -> Tensor:
        x = x + self.attn(self.ln1(x), kv)
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden, dtype=cfg.torch_dtype)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden, dtype=cfg.torch_dtype)

    def forward(self, idx: Tensor, offset: int = 0) -> Tensor:
        """idx: LongTensor [b, s] of tokens at positions offset..offset+s-1."""
        s = idx.size(1)
        if offset + s > self.pos.num_embeddings:
            raise ValueError(
                f"positions {offset}..{offset + s - 1} exceed the model's context of {self.pos.num_embeddings}: "
                "use shorter sequences or a larger GPTConfig.seq"
            )
        positions = torch.arange(offset, offset + s, device=idx.device)
        return self.tok(idx) + self.pos(positions)


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden, dtype=cfg.torch_dtype)
        self.out = nn.Linear(cfg.hidden, cfg.vocab, bias=False, dtype=cfg.torch_dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))


class GPT(nn.Module):
    """The whole model in one module: what one process trains as the reference."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.head = Head(cfg)
        init_parameters(self, cfg, seed=seed)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def init_parameters(module: nn.Module, cfg: GPTConfig, *, seed: int) -> None:
    """Fill every parameter from (seed, its name), so any subset of the model can be built alone.

    GPT-2 style: weights N(0, 0.02), the residual projections (attn.proj, mlp.down) scaled
    by 1/sqrt(2·layers), biases zero, LayerNorm weight one. Values are drawn in float64 and
    cast, so a float32 and a float64 model from one seed agree to float32 rounding.
    Parameters on the meta device (a skeleton the splitter builds) are left alone.
    """
    fill = parameter_init(cfg, seed=seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if not param.is_meta:
                fill(name, param)


def parameter_init(cfg: GPTConfig, *, seed: int) -> Callable[[str, Tensor], None]:
    """`init(name, tensor)`: the initializer of `init_parameters`, one parameter at a time."""
    residual_std = 0.02 / math.sqrt(2 * cfg.layers)

    def init(name: str, param: Tensor) -> None:
        with torch.no_grad():
            if name.endswith(".bias"):
                param.zero_()
            elif ".ln" in name or "norm." in name:
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith(("attn.proj.weight", "mlp.down.weight")) else 0.02
                seeded_normal_(param, seed=seed, name=name, std=std)

    return init


class GPTAdapter(BlockAdapter):
    """The embedding takes the chunk's position offset; each block takes its K/V extender."""

    supports_sequence_chunks = True

    def run_before(self, name, module, x, chunk):
        return module(x, chunk.offset if chunk is not None else 0)

    def run_block(self, name: str, block: nn.Module, h, ctx):
        return block(h, ctx.kv(name) if ctx is not None else None)


def gpt_spec(cfg: GPTConfig):
    """The reference GPT of `cfg` as a `ModelSpec` (weights from the run's seed)."""
    return ModelSpec(name="gpt", title="GPT", build=lambda: GPT(cfg, seed=0), layout=GPT_LAYOUT,
                     shape=gpt_shape(cfg), init=lambda seed: parameter_init(cfg, seed=seed), adapter=GPTAdapter(),
                     loss=cross_entropy, tp_plan=gpt_tp_plan)


def gpt_tp_plan():
    """The GPT's tensor-parallel plan (`models.tp_plan`): fused qkv and MLP up split by
    columns (heads, inner features), the attention and MLP outputs by rows; token and
    position tables split by rows, the LM head by vocabulary columns; LayerNorms run on the
    token shard (sequence parallelism)."""
    from torch.distributed.tensor import Replicate, Shard  # DTensor takes 0.4 s to import: loaded only for a tensor-parallel run
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    block = {
        "ln1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                   use_local_output=True),
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ln2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    first = {
        "embed.tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        # positions [s] -> [s, h]: sharded by tokens on its dim 0, which broadcasts onto dim 1 of [b, s, h]
        "embed.pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0), use_local_output=False),
    }
    last = {
        "head.norm": SequenceParallel(),
        "head.out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    return TPPlan(block=block, first=first, last=last)
