"""A decoder's shape, as the simulator, the memory model and the planner need it: no torch.

    >>> ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, mlp="swiglu", norm="rmsnorm",
    ...            positions="rotary", vocab=128256, linear_bias=False)        # shaped like Llama-3-8B
    >>> GPT_SHAPE = ModelShape(layers=8, hidden=64, heads=4, vocab=256, context=64)   # the reference GPT

Every model `pipeblocks train` runs has one (`pipeblocks.models.ModelSpec.shape`), and so
does every `--hf` directory (its config.json) and every `--model` preset of the simulator.
The defaults describe the reference GPT (learned positions, LayerNorm, a GELU MLP of 4h,
a bias on every projection but the head), so a shape that names only layers, hidden,
heads and vocab is a GPT's.

What it fixes, per decoder block (h = hidden, d = head_dim, a = heads, k = kv_heads,
f = ffn):

    attention   q: h x a*d, k and v: h x k*d each, out: a*d x h (grouped-query when k < a)
    MLP         gelu: up h x f and down f x h;  swiglu: gate and up h x f, down f x h
    biases      linear_bias: on q, k, v, out, up (and gate), down;  qkv_bias: on q, k, v only
    norms       two per block (LayerNorm: weight and bias; RMSNorm: weight); qk_norm: one
                RMSNorm of d on the queries and one on the keys (Qwen3)

and at the ends: the token embedding V x h (and a learned position table context x h) on
the first stage; the final norm and the head h x V on the last. A tied head (`tied`)
shares the embedding's weight: the first and last stages each hold a copy, kept equal.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

__all__ = ["MLP_KINDS", "NORM_KINDS", "POSITION_KINDS", "ModelShape"]

MLP_KINDS = ("gelu", "swiglu")
"""gelu: two projections (up, down); swiglu: three (gate, up, down), down(silu(gate(x)) * up(x))."""
NORM_KINDS = ("layernorm", "rmsnorm")
POSITION_KINDS = ("learned", "rotary")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer (see the module docstring for what each fixes)."""

    layers: int
    """decoder blocks (the embedding and the head are not counted)"""
    hidden: int
    """model width h"""
    heads: int
    """query heads a"""
    vocab: int
    """vocabulary V (the embedding's rows and the head's outputs)"""
    kv_heads: int | None = None
    """key/value heads k (grouped-query attention); None: as many as heads"""
    head_dim: int | None = None
    """width d of one head; None: hidden / heads"""
    ffn: int | None = None
    """the MLP's inner width f; None: 4h for gelu, Llama's rule (8h/3 up to a multiple of 8) for swiglu"""
    mlp: str = "gelu"
    norm: str = "layernorm"
    positions: str = "learned"
    context: int | None = None
    """the longest sequence the model runs (a learned position table's rows); None: unbounded"""
    tied: bool = False
    """the head shares the embedding's weight"""
    linear_bias: bool = True
    """every projection of a block has a bias (GPT-2); the head never has one"""
    qkv_bias: bool = False
    """only q, k and v have biases (Qwen2)"""
    qk_norm: bool = False
    """an RMSNorm of d on every query and key head (Qwen3)"""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab"):
            _count(name, getattr(self, name))
        for name in ("kv_heads", "head_dim", "ffn", "context"):
            if getattr(self, name) is not None:
                _count(name, getattr(self, name))
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) is not a multiple of heads ({self.heads}): give head_dim, or "
                             "a hidden that heads divides")
        if self.heads % self.num_kv_heads:
            raise ValueError(f"kv_heads ({self.num_kv_heads}) must divide heads ({self.heads}) for grouped-query "
                             "attention")
        for name, kinds in (("mlp", MLP_KINDS), ("norm", NORM_KINDS), ("positions", POSITION_KINDS)):
            if getattr(self, name) not in kinds:
                raise ValueError(f"ModelShape.{name} {getattr(self, name)!r}: choose one of {', '.join(kinds)}")
        if self.positions == "learned" and self.context is None:
            raise ValueError("learned positions need a context (the position table's rows): give context")

    # ---- resolved sizes ---------------------------------------------------------------
    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def dim(self) -> int:
        """d, one head's width."""
        return self.hidden // self.heads if self.head_dim is None else self.head_dim

    @property
    def ffn_width(self) -> int:
        if self.ffn is not None:
            return self.ffn
        if self.mlp == "gelu":
            return 4 * self.hidden
        return 8 * math.ceil(8 * self.hidden / 3 / 8)

    @property
    def q_width(self) -> int:
        """a*d: the queries' (and the attention output's) width."""
        return self.heads * self.dim

    @property
    def kv_width(self) -> int:
        """k*d: the keys' width (and the values')."""
        return self.num_kv_heads * self.dim

    @property
    def mlp_matrices(self) -> int:
        """h x f matrices of the MLP: 2 (gelu) or 3 (swiglu)."""
        return 2 if self.mlp == "gelu" else 3

    # ---- parameters ---------------------------------------------------------------------
    def layer_weights(self) -> int:
        """The elements of one block's projection matrices (what its matrix products multiply)."""
        h = self.hidden
        return 2 * h * self.q_width + 2 * h * self.kv_width + self.mlp_matrices * h * self.ffn_width

    def layer_params(self) -> int:
        """Every parameter of one block: its matrices, biases and norms."""
        h, f = self.hidden, self.ffn_width
        biases = 0
        if self.linear_bias:
            biases = self.q_width + 2 * self.kv_width + h + (self.mlp_matrices - 1) * f + h
        elif self.qkv_bias:
            biases = self.q_width + 2 * self.kv_width
        return self.layer_weights() + biases + 2 * self.norm_params(h) + (2 * self.dim if self.qk_norm else 0)

    def norm_params(self, width: int) -> int:
        return 2 * width if self.norm == "layernorm" else width

    def embedding_params(self) -> int:
        """The first stage's extra parameters: the token embedding and a learned position table."""
        positions = self.context * self.hidden if self.positions == "learned" else 0
        return self.vocab * self.hidden + positions

    def head_params(self) -> int:
        """The last stage's extra parameters: the final norm and the head (its own copy when tied)."""
        return self.norm_params(self.hidden) + self.hidden * self.vocab

    def stage_params(self, layers_per_stage: tuple[int, ...]) -> tuple[int, ...]:
        """Parameters per stage, for the blocks each holds (`core.cost.split.layer_counts`)."""
        last = len(layers_per_stage) - 1
        return tuple(n * self.layer_params() + (self.embedding_params() if i == 0 else 0)
                     + (self.head_params() if i == last else 0) for i, n in enumerate(layers_per_stage))

    def total_params(self) -> int:
        """The model's parameters, a tied weight counted once."""
        return (self.layers * self.layer_params() + self.embedding_params() + self.head_params()
                - (self.hidden * self.vocab if self.tied else 0))

    # ---- text ---------------------------------------------------------------------------
    def describe(self) -> str:
        """'8 layers, hidden 64, 4 heads (2 KV), SwiGLU 176, vocabulary 256, tied'."""
        kv = f" ({self.num_kv_heads} KV)" if self.num_kv_heads != self.heads else ""
        mlp = f"{'SwiGLU' if self.mlp == 'swiglu' else 'GELU'} {self.ffn_width}"
        return (f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads{kv}, {mlp}, vocabulary {self.vocab}"
                + (", tied" if self.tied else ""))

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> ModelShape:
        known = {f.name for f in fields(ModelShape)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model shape fields {unknown}: known are {sorted(known)}")
        return ModelShape(**data)


def _count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelShape.{name} must be an integer >= 1, got {value!r}")
