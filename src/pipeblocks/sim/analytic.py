"""An analytic transformer cost model: pass times and activation bytes per stage from a
model config and a hardware profile.

The model is a decoder of `layers` blocks (`TransformerConfig`, whose sizes are a
`core.cost.model_shape.ModelShape`): with s = sequence, b = microbatch size, h = hidden,
a = query heads, k = key/value heads, d = head width (a*d the queries' width, k*d the
keys' and the values'), f = the MLP's inner width, V = vocabulary, and
W_l = 2*h*(a*d) + 2*h*(k*d) + m*h*f the elements of one block's projection matrices
(q and out: h x a*d; k and v: h x k*d; the MLP's m = 2 (GELU: up, down) or 3 (SwiGLU:
gate, up, down) matrices of h x f), the FLOPs of one block per microbatch are::

    F = 2*s*b*W_l + 4*s^2*b*(a*d)    B = 2*s*b*W_l + 8*s^2*b*(a*d)    W = 2*s*b*W_l    (B + W = 2F)

the matrix products' 2 FLOPs per weight and token, and attention's q.k^T and p.v
products of 2*s*d FLOPs per query and head each (the Zero Bubble paper's Table 1,
whose GPT has W_l = 12h^2 and a*d = h: F = s*b*h*(24h + 4s), B = s*b*h*(24h + 8s),
W = 24*s*b*h^2). Biases, norms, rotary and element-wise work are not counted (O(s*b*h)).
The last stage adds the LM head, 2*s*b*h*V FLOPs to each of F, B and W, tied or not, and
its softmax cross entropy, which does few FLOPs per logit but streams the s*b*V logits
through memory (`cross_entropy_bytes`): priced at the profile's `memory_bandwidth` (in F,
reading the logits twice and writing the log-probabilities; in B, reading those and
writing the logits' gradient), nothing where the bandwidth is unknown. The embedding is a
lookup (no FLOPs) and its backward a scatter of s*b*h gradients, neither priced.

Activation bytes (what autograd saves for the backward) are listed term by term in
`layer_activation_bytes` and `stage_activation_bytes` and in docs/memory.md. For the GPT,
with dropout and 16-bit activations, a layer saves M_B = s*b*(34h + 5*a*s) as in
Megatron's accounting (Korthikanti et al. 2022), plus the LayerNorm statistics; with flash
attention the s x s scores are not stored and a log-sum-exp per query and head is
(M_B = 34*s*b*h + 4*a*s*b + 16*s*b). M_W = 32*s*b*h (`transformer_w_ratio`).

Layers per stage follow `core.cost.split.layer_counts`, which gives the end stages the lighter
share of an uneven split, or the config's own `split` (`--split 3,4,4,3`, or the counts
`--split auto` chose). The first stage also saves the token ids (and a learned position
table's ids); the last saves the final norm's input and output and the loss's
log-probabilities (fp32, s*b*V*4 bytes), which at a vocabulary of 128k outweigh several
layers. Time = FLOPs / (peak FLOP/s * achievable fraction), plus, with a calibrated
profile, its fixed overhead per pass of a block, of the embedding and of the head
(`Hardware.overhead`); one hop between ranks takes latency + s*b*h*dtype_bytes / bandwidth.

Parameters per stage (they size the data-parallel collectives and the static memory) are
`ModelShape.stage_params`: per block its matrices, biases and norms (the GPT's
12h^2 + 13h), the token embedding V*h (and a learned position table, s*h for the GPT)
on the first stage, the final norm and the head h*V on the last. A tied head is the
embedding's weight, but the first and last stages each hold a copy (kept equal by
summing their gradients), so both count; on a single stage it is one tensor.

Data-parallel link: the mesh orders ranks (pp, dp), so a stage's d replicas are
consecutive ranks and share a node when d <= gpus_per_node; a ring that leaves the node
runs at the inter-node link (`dp_link`).

    >>> from pipeblocks.sim.analytic import MODELS, HARDWARE, transformer_costs
    >>> costs = transformer_costs(MODELS["1.5b"], HARDWARE["a100"], num_stages=8)
    >>> costs = transformer_costs(MODELS["llama-3-8b"], HARDWARE["h100"], num_stages=4)
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from types import MappingProxyType

from ..core.ir.errors import ScheduleError
from ..core.cost.costs import Costs
from ..core.cost.dp_model import Link
from ..core.cost.hf_config import read_hf_config
from ..core.cost.model_shape import ModelShape
from ..core.cost.split import check_split, layer_counts, stage_layers

__all__ = [
    "TransformerConfig", "Hardware", "MODELS", "HARDWARE", "layer_split", "layer_activation_bytes", "transformer_costs",
    "parse_model", "stage_params", "dp_link", "stage_activation_bytes", "loss_activation_bytes",
    "transformer_w_ratio", "PassEfficiency", "layer_intensity", "head_intensity", "stage0_backward_in_w",
    "layer_flops", "head_flops", "sequence_flops", "layer_gemms", "w_elements", "rotary_table_bytes",
    "model_from_hf", "HF_SEQ", "cross_entropy_bytes",
]

_DTYPE_BYTES = MappingProxyType({"fp32": 4, "float32": 4, "bf16": 2, "fp16": 2, "float16": 2, "float64": 8})


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer as the cost model prices it: its sizes (those of a
    `core.cost.model_shape.ModelShape`, the `shape` property) and how it is trained (sequence,
    microbatch, dtype, attention kernel, dropout). The defaults are the reference GPT's
    (multi-head attention of width h, a GELU MLP of 4h, LayerNorm, learned positions, a bias
    on every projection, an untied head), so `TransformerConfig(layers, hidden, heads, seq)`
    prices what it always did.

    layers, hidden, heads: the transformer stack (heads: query heads).
    seq: tokens per sequence.  vocab: vocabulary (padded).  microbatch_size: sequences per microbatch.
    dtype: activation dtype name (bf16, fp16, fp32, float64).
    flash_attention: attention that does not store the s x s scores (drops the 5*a*s term
        of M_B and keeps a log-sum-exp per query and head instead), as long-sequence
        training and torch's scaled_dot_product_attention do.
    dropout: the model trains with dropout, whose masks are saved for the backward (one
        byte per element: after attention, after the MLP, on the embedding, and on the
        attention probabilities unless flash attention). Megatron's accounting has it; the
        reference GPT of `pipeblocks train` and the Llama-style models have no dropout.

    kv_heads, head_dim, ffn, mlp, norm, positions, context, tied, linear_bias, qkv_bias,
        qk_norm: the block's shape, as `ModelShape` (whose docstring says what each fixes),
        except that context None is seq here (the reference GPT's rule).
    split: transformer layers per global stage, in stage order (`--split 3,4,4,3`), or None
        for `core.cost.split.layer_counts`'s even rule; `stage_layers` answers either way.
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int = 51200
    microbatch_size: int = 1
    dtype: str = "bf16"
    flash_attention: bool = False
    dropout: bool = True
    kv_heads: int | None = None
    head_dim: int | None = None
    ffn: int | None = None
    mlp: str = "gelu"
    norm: str = "layernorm"
    positions: str = "learned"
    context: int | None = None
    tied: bool = False
    linear_bias: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab", "microbatch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"model {name} must be an integer >= 1, got {value!r}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ScheduleError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.dtype not in _DTYPE_BYTES:
            raise ScheduleError(f"unknown dtype {self.dtype!r}; choose one of {sorted(_DTYPE_BYTES)}")
        try:
            _ = self.shape  # ModelShape checks the block's sizes and kinds
        except ValueError as err:
            raise ScheduleError(f"model: {err}") from None
        if self.split is not None:
            object.__setattr__(self, "split", tuple(self.split))
            try:
                check_split(self.split, layers=self.layers, num_stages=len(self.split))
            except ValueError as err:
                raise ScheduleError(str(err)) from None
        if self.positions == "learned" and self.context is not None and self.seq > self.context:
            raise ScheduleError(f"seq {self.seq} is longer than the learned position table's {self.context} rows "
                                f"(context): give seq <= {self.context}")

    @classmethod
    def from_shape(cls, shape: ModelShape, *, seq: int, microbatch_size: int = 1, dtype: str = "bf16",
                   flash_attention: bool = False, dropout: bool = False) -> TransformerConfig:
        """The config that prices `shape` trained on sequences of `seq` tokens, `microbatch_size` per
        microbatch; `config.shape == shape`."""
        if not isinstance(shape, ModelShape):
            raise TypeError(f"shape must be a ModelShape, got {type(shape).__name__}")
        return cls(**dataclasses.asdict(shape), seq=seq, microbatch_size=microbatch_size, dtype=dtype,
                   flash_attention=flash_attention, dropout=dropout)

    @functools.cached_property
    def shape(self) -> ModelShape:
        """The model's sizes; a learned position table without a context has seq rows."""
        sizes = {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelShape)}
        if sizes["context"] is None and self.positions == "learned":
            sizes["context"] = self.seq
        return ModelShape(**sizes)

    def stage_layers(self, num_stages: int) -> tuple[int, ...]:
        """Layers per global stage: `split` when given (it must have `num_stages` entries),
        else the splitter's even rule (`core.cost.split.layer_counts`)."""
        try:
            return stage_layers(self.layers, num_stages, self.split)
        except ValueError as err:
            raise ScheduleError(str(err)) from None

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def hidden_bytes(self) -> int:
        """Bytes of one microbatch's hidden states, s*b*h*dtype_bytes (what a hop carries)."""
        return self.seq * self.microbatch_size * self.hidden * self.dtype_bytes

    @property
    def fused_qkv(self) -> bool:
        """The reference GPT's module layout (`pipeblocks train --model-family gpt`): one fused q/k/v
        projection and a GELU MLP, LayerNorms, learned positions, multi-head attention. Every other
        shape is laid out as Llama's and Hugging Face's decoders are: separate q, k, v and o
        projections; gate, up and down. It decides the parameter tensors (`sim.tp_memory`) and the
        GEMMs the intensity model sizes (`layer_gemms`), not the FLOPs or the parameter count."""
        shape = self.shape
        return (self.mlp == "gelu" and self.norm == "layernorm" and self.positions == "learned"
                and shape.num_kv_heads == self.heads and shape.dim * self.heads == self.hidden and not self.qk_norm)


@dataclass(frozen=True)
class PassEfficiency:
    """The achievable fraction of the peak for one pass kind, as a function of the arithmetic
    intensity I (FLOPs per byte) of the pass's matrix products: ceiling / (1 + ridge / I),
    the planner's roofline form (`plan.intensity`); ridge 0 is a constant fraction.
    overhead: seconds a pass of one block takes beyond its FLOPs' time (the fixed cost of its
    operators, measured by `pipeblocks calibrate`; microseconds on a GPU); embedding_overhead
    and head_overhead: the same for the first stage's embedding and the last stage's head."""

    ceiling: float
    ridge: float = 0.0
    overhead: float = 0.0
    embedding_overhead: float = 0.0
    head_overhead: float = 0.0

    def __post_init__(self) -> None:
        fixed = (self.overhead, self.embedding_overhead, self.head_overhead)
        if not (math.isfinite(self.ceiling) and math.isfinite(self.ridge) and self.ceiling > 0 and self.ridge >= 0
                and all(math.isfinite(x) and x >= 0 for x in fixed)):
            raise ScheduleError(f"pass efficiency needs a finite ceiling > 0, ridge >= 0 and overheads >= 0, got "
                                f"ceiling={self.ceiling}, ridge={self.ridge}, overheads={fixed}")

    def at(self, intensity: float) -> float:
        """The fraction at `intensity` (FLOPs per byte; 0 or less: no matrix product, the ceiling)."""
        if self.ridge == 0 or intensity <= 0:
            return self.ceiling
        return self.ceiling / (1.0 + self.ridge / intensity)


@dataclass(frozen=True)
class Hardware:
    """A device, its pipeline link and its data-parallel links.

    flops: peak FLOP/s at the activation dtype.  efficiency: the achievable fraction of it.
    bandwidth: bytes/s of one point-to-point hop.  latency: seconds per hop.
    gpus_per_node: devices that share the intra-node link.
    intra_bandwidth, intra_latency: the link inside a node (bytes/s per device, seconds per
        ring step).  inter_bandwidth, inter_latency: between nodes.
    memory_bandwidth: the device memory's bytes/s (HBM), or None when unknown. The
        simulator's pass times do not use it; the planner's kernel-efficiency model
        (`plan.intensity`) does.
    passes: (F, B, W) fitted fractions of a calibrated profile (`sim.hardware_profile`),
        used instead of `efficiency` for the pass times, with each kind's fixed overhead per
        pass of a block; None for the built-in profiles.
    overlap: the share of the shorter part of an overlapped forward-backward pair (DualPipe)
        that the pair hides, 0..1: communication of one part (expert parallelism's all-to-all)
        under the other's compute. 0 for every built-in profile and on a CPU: the parts then
        run one after the other (`Costs.overlap`).
    """

    name: str
    flops: float
    efficiency: float
    bandwidth: float
    latency: float
    gpus_per_node: int = 8
    intra_bandwidth: float = 300e9
    intra_latency: float = 5e-6
    inter_bandwidth: float = 25e9
    inter_latency: float = 10e-6
    memory_bandwidth: float | None = None
    passes: tuple[PassEfficiency, PassEfficiency, PassEfficiency] | None = None
    overlap: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.overlap, (int, float)) and 0 <= self.overlap <= 1):
            raise ScheduleError(f"hardware {self.name!r}: overlap is a share 0..1 of a pair's shorter part, "
                                f"got {self.overlap!r}")
        values = (self.flops, self.efficiency, self.bandwidth, self.latency)
        # NaN fails no comparison, so finiteness is checked on its own
        if (not all(math.isfinite(x) for x in values) or self.flops <= 0 or self.bandwidth <= 0 or self.latency < 0
                or not 0 < self.efficiency <= 1):
            raise ScheduleError(
                f"hardware {self.name!r}: need finite flops > 0, bandwidth > 0, latency >= 0 and 0 < efficiency <= 1, "
                f"got flops={self.flops}, efficiency={self.efficiency}, bandwidth={self.bandwidth}, "
                f"latency={self.latency}"
            )
        if self.gpus_per_node < 1 or min(self.intra_bandwidth, self.inter_bandwidth) <= 0 or min(
            self.intra_latency, self.inter_latency
        ) < 0:
            raise ScheduleError(f"hardware {self.name!r}: need gpus_per_node >= 1, link bandwidths > 0, latencies >= 0")
        memory = self.memory_bandwidth
        if memory is not None and not (math.isfinite(memory) and memory > 0):
            raise ScheduleError(
                f"hardware {self.name!r}: memory_bandwidth must be a finite number of bytes/s > 0 or None, got {memory}"
            )
        if self.passes is not None and (len(self.passes) != 3 or not all(isinstance(x, PassEfficiency)
                                                                         for x in self.passes)):
            raise ScheduleError(f"hardware {self.name!r}: passes must be three PassEfficiency (F, B, W) or None")

    def fraction(self, kind: int, intensity: float) -> float:
        """The achievable fraction for pass `kind` (0 F, 1 B, 2 W) at `intensity` FLOPs per byte."""
        return self.efficiency if self.passes is None else self.passes[kind].at(intensity)

    def overhead(self, kind: int, part: str = "block") -> float:
        """Seconds pass `kind` (0 F, 1 B, 2 W) of one block (or of the "embedding" or the
        "head") takes beyond its FLOPs' time (0 for the built-in profiles)."""
        if self.passes is None:
            return 0.0
        fit = self.passes[kind]
        return {"block": fit.overhead, "embedding": fit.embedding_overhead, "head": fit.head_overhead}[part]


# Models of the Zero Bubble paper's experiments (§9.1 of the algorithms reference).
MODELS = MappingProxyType({
    "1.5b": TransformerConfig(layers=22, hidden=2304, heads=24, seq=1024, microbatch_size=6),
    "6.2b": TransformerConfig(layers=30, hidden=4096, heads=32, seq=1024, microbatch_size=3),
    "14.6b": TransformerConfig(layers=46, hidden=5120, heads=40, seq=1024, microbatch_size=1),
    "28.3b": TransformerConfig(layers=62, hidden=6144, heads=48, seq=1024, microbatch_size=1),
    # Models of "Pipeline Parallelism with Controllable Memory" (Qi et al. 2024, Table 3 and
    # section 5); their sequence and microbatch size vary by experiment (`pipeblocks plan` sets them)
    "9.6b": TransformerConfig(layers=30, hidden=5120, heads=40, seq=1024),
    "21b": TransformerConfig(layers=46, hidden=6144, heads=48, seq=1024),
    "38.5b": TransformerConfig(layers=62, hidden=7168, heads=64, seq=1024),
    "98.5b": TransformerConfig(layers=78, hidden=10240, heads=80, seq=1024),
    # Shaped like the public config.json of these models (RMSNorm, rotary positions, SwiGLU,
    # grouped-query attention, an untied head, no dropout), priced at 4096-token sequences,
    # a common pre-training length within their context (`--seq` and the planner override
    # it); `TransformerConfig.from_shape(read_hf_config(dir).shape, seq=4096)` equals them
    "llama-3-8b": TransformerConfig(
        layers=32, hidden=4096, heads=32, seq=4096, vocab=128256, dropout=False, kv_heads=8, ffn=14336,
        mlp="swiglu", norm="rmsnorm", positions="rotary", context=8192, linear_bias=False,
    ),
    "llama-3-70b": TransformerConfig(
        layers=80, hidden=8192, heads=64, seq=4096, vocab=128256, dropout=False, kv_heads=8, ffn=28672,
        mlp="swiglu", norm="rmsnorm", positions="rotary", context=8192, linear_bias=False,
    ),
    # q, k and v have biases, the other projections none
    "qwen2.5-7b": TransformerConfig(
        layers=28, hidden=3584, heads=28, seq=4096, vocab=152064, dropout=False, kv_heads=4, ffn=18944,
        mlp="swiglu", norm="rmsnorm", positions="rotary", context=131072, linear_bias=False, qkv_bias=True,
    ),
})

# Dense 16-bit peak, a typical achievable fraction, and an inter-node link (one NIC) for the
# pipeline. Data-parallel links: NVLink inside a node (nominal per-GPU figures), the NIC
# between nodes. `cloud`: A100-class nodes of 8 joined by slow Ethernet (50 Gb/s per GPU).
# The fractions 0.5 (a100, cloud) and 0.45 (h100) are round figures from published
# end-to-end MFU of large GPT training (Megatron-LM, Narayanan et al. 2021: 52% of an A100's
# peak with bubbles and communication), left as they were; one measurement agrees that they
# are conservative for large layers: on one H200 (989 TFLOP/s dense bf16, the H100's
# compute) with torch 2.11, the reference GPT's block reached 0.49-0.70 of the peak in F,
# 0.37-0.62 in B and 0.42-0.59 in W at hidden 2048-8192, varying with shape.
# `pipeblocks calibrate` measures the user's own device instead (sim.hardware_profile).
HARDWARE = MappingProxyType({
    "a100": Hardware(
        "a100", flops=312e12, efficiency=0.5, bandwidth=25e9, latency=10e-6,
        intra_bandwidth=300e9, intra_latency=5e-6, inter_bandwidth=25e9, inter_latency=10e-6,
        memory_bandwidth=1.555e12,
    ),
    "h100": Hardware(
        "h100", flops=989e12, efficiency=0.45, bandwidth=50e9, latency=10e-6,
        intra_bandwidth=450e9, intra_latency=5e-6, inter_bandwidth=50e9, inter_latency=10e-6,
        memory_bandwidth=3.35e12,
    ),
    "cloud": Hardware(
        "cloud", flops=312e12, efficiency=0.5, bandwidth=6.25e9, latency=30e-6,
        intra_bandwidth=300e9, intra_latency=5e-6, inter_bandwidth=6.25e9, inter_latency=30e-6,
        memory_bandwidth=1.555e12,
    ),
    # An A100 SXM 80GB in a DGX A100-style node of 8, from NVIDIA's data sheets: 312 TFLOP/s
    # dense bf16; NVLink 3 at 600 GB/s per GPU both directions, so 300 GB/s each way inside
    # the node; one 200 Gb/s HDR InfiniBand adapter per GPU (25 GB/s) between nodes, which
    # also carries the pipeline's hops. The achievable fraction 0.6 is the share of peak a
    # large transformer layer reaches in Megatron-LM on A100 (Narayanan et al. 2021 report
    # 52% of peak for whole GPT runs with pipeline bubbles and communication included; the
    # layer itself runs faster). Latencies: a few microseconds per NVLink step, about 10
    # per InfiniBand step, NCCL's order of magnitude. HBM2e at 2039 GB/s (the 80GB SXM data
    # sheet; the 40GB part and the `a100`/`cloud` profiles: 1555 GB/s; H100 SXM: 3.35 TB/s).
    "a100-80g": Hardware(
        "a100-80g", flops=312e12, efficiency=0.6, bandwidth=25e9, latency=10e-6,
        intra_bandwidth=300e9, intra_latency=5e-6, inter_bandwidth=25e9, inter_latency=10e-6,
        memory_bandwidth=2.039e12,
    ),
})


def dp_link(hardware: Hardware, dp: int) -> Link:
    """The link a ring over `dp` consecutive replicas runs at: intra-node when they fit in
    one node, else the slower inter-node link (a ring is as fast as its slowest hop)."""
    if dp <= hardware.gpus_per_node:
        return Link(hardware.intra_bandwidth, hardware.intra_latency)
    return Link(hardware.inter_bandwidth, hardware.inter_latency)


def stage_params(config: TransformerConfig, num_stages: int) -> tuple[int, ...]:
    """Parameters per stage (`ModelShape.stage_params`): its blocks' matrices, biases and norms,
    the token embedding (and a learned position table) on the first stage, the final norm and
    the head on the last. A tied head counts on both end stages, which each hold a copy; a
    single stage holds the one tensor once."""
    params = config.shape.stage_params(config.stage_layers(num_stages))
    if config.tied and num_stages == 1:
        return (params[0] - config.hidden * config.vocab,)
    return params


def layer_split(layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage: the model splitter's rule (`core.cost.split.layer_counts`), so the
    analytic costs describe the stages the runtime builds."""
    return layer_counts(layers, num_stages)


# statistics a norm saves per token (fp32 at least): LayerNorm its mean and reciprocal
# deviation, RMSNorm its reciprocal root mean square
_NORM_STATISTICS = MappingProxyType({"layernorm": 2, "rmsnorm": 1})


def layer_flops(config: TransformerConfig) -> tuple[int, int, int]:
    """F, B and W FLOPs of one block for one microbatch: 2*s*b*W_l for the matrix products
    (W_l = `ModelShape.layer_weights`) in each pass, and attention's two s x s products,
    2*s^2*b*(a*d) each, once in F and twice in B (the module docstring)."""
    s, b = config.seq, config.microbatch_size
    matrices = 2 * s * b * config.shape.layer_weights()
    attention = 4 * s * s * b * config.shape.q_width
    return matrices + attention, matrices + 2 * attention, matrices


def head_flops(config: TransformerConfig) -> int:
    """FLOPs of the LM head in each of F, B and W: an s*b x h by h x V product (tied or not)."""
    return 2 * config.seq * config.microbatch_size * config.hidden * config.vocab


def sequence_flops(config: TransformerConfig) -> int:
    """Model FLOPs of one sequence, forward and backward (F + B + W = 3F): the blocks'
    6*s*W_l + 12*s^2*(a*d) each and the head's 6*s*h*V. For the GPT,
    72*s*h^2*L*(1 + s/(6h) + V/(12*h*L)), as Megatron-LM counts MFU."""
    s, shape = config.seq, config.shape
    block = 6 * s * shape.layer_weights() + 12 * s * s * shape.q_width
    return config.layers * block + 6 * s * config.hidden * config.vocab


def layer_activation_bytes(config: TransformerConfig, tokens: int, keys: int, *, kv: bool = True) -> float:
    """Bytes one layer's forward saves for `tokens` queries attending over `keys` keys, per
    microbatch. Per token, with e the activation element size, f = max(4, e) the size of the
    statistics kept in fp32 at least, h hidden, a query heads, k key/value heads, d the head
    width and f_m the MLP's inner width (a pre-norm block)::

        4*h*e        the block input, the first norm's output (the q, k, v products' input),
                     the residual after attention and the second norm's output (the MLP's input)
        (a*d + 2*k*d)*e   q, k and v as attention takes them (after rotary positions)
        a*d*e        the attention output (the out projection's input)
        2*f_m*e      GELU: the up product's output (GELU's input) and GELU's output (the down
                     product's input)
        4*f_m*e      SwiGLU, down(silu(gate(x)) * up(x)): the gate product's output (SiLU's
                     input), SiLU's output and the up product's output (the product's inputs)
                     and their product (the down product's input)
        2*n*f        the two norms' statistics: n = 2 for LayerNorm (mean and reciprocal
                     deviation), 1 for RMSNorm (reciprocal root mean square)
        qk_norm      (a*d + k*d)*e, q and k before their norm, and (a + k)*f statistics
        a*f          flash attention: one log-sum-exp per query head;  else  a*keys*e  probabilities
        dropout: 2*h (masks after attention and after the MLP, a byte each), and without
                 flash attention a*keys*(1 + e) (the probabilities' mask and dropped copy)

    For the reference GPT (a*d = k*d = h, f_m = 4h, LayerNorm) that is 16*h*e + 4*f + ...;
    with dropout and 16-bit activations Megatron's 34*h + 5*a*s (plus 16 bytes).

    What is assumed: biases save nothing (an addition's backward needs no input); an RMSNorm
    is fused (torch's rms_norm on CUDA, `_fused_rms_norm`, keeps its input and the statistic;
    on CPU torch composes it of elementary operations, which also keep the normalised tensor,
    h*e more per norm: measured on the Llama-style block, that is the whole difference);
    rotary positions multiply q and k by cos and
    sin tables that take no gradient, so they save those tables, once per stage and
    microbatch (`rotary_table_bytes`), and not q or k again; attention reads K and V at k
    heads (scaled_dot_product_attention with enable_gqa, flash kernels): an implementation
    that repeats them to a heads before the products saves 2*(a - k)*d*e more, not counted.
    kv=False leaves K and V out (2*k*d*e: a sequence chunk's K/V live in a buffer of the
    whole sequence)."""
    b, h, a = config.microbatch_size, config.hidden, config.heads
    shape = config.shape
    q, kv_width = shape.q_width, shape.kv_width
    e = config.dtype_bytes
    f = max(4, e)
    mlp = (2 if config.mlp == "gelu" else 4) * shape.ffn_width
    elements = 4 * h + 2 * q + mlp + (2 * kv_width if kv else 0)
    statistics = 2 * _NORM_STATISTICS[config.norm]
    if config.qk_norm:
        elements += q + kv_width
        statistics += a + shape.num_kv_heads
    per_token = elements * e + statistics * f
    per_token += a * f if config.flash_attention else a * keys * e
    if config.dropout:
        per_token += 2 * h + (0 if config.flash_attention else a * keys * (1 + e))
    return tokens * b * per_token


def rotary_table_bytes(config: TransformerConfig) -> int:
    """What rotary positions save on every stage per microbatch: the cos and sin tables of
    the sequence's positions, s x d each in the activation dtype, computed once by the stage
    and shared by its layers (0 with learned positions)."""
    if config.positions != "rotary":
        return 0
    return 2 * config.seq * config.shape.dim * config.dtype_bytes


def loss_activation_bytes(config: TransformerConfig) -> float:
    """What the loss saves on the last stage per microbatch, freed by its backward (B):
    the log-probabilities (fp32 at least, s*b*V*f), the int64 targets and one scalar."""
    tokens = config.seq * config.microbatch_size
    return tokens * (config.vocab * max(4, config.dtype_bytes) + 8) + config.dtype_bytes


def cross_entropy_bytes(config: TransformerConfig) -> tuple[float, float]:
    """Bytes the softmax cross entropy moves through device memory per microbatch, (F, B),
    with e the activation element size and f = max(4, e) (log-probabilities kept in fp32 at
    least): F reads the s*b*V logits twice (their maximum, then the sum of exponentials) and
    writes the log-probabilities, s*b*V*(2e + f); B reads the log-probabilities and writes
    the logits' gradient, s*b*V*(f + e). A memory-bound pass: its time is these bytes over
    the device's memory bandwidth."""
    logits = config.seq * config.microbatch_size * config.vocab
    e, f = config.dtype_bytes, max(4, config.dtype_bytes)
    return logits * (2 * e + f), logits * (f + e)


def stage_activation_bytes(config: TransformerConfig, num_stages: int) -> tuple[float, ...]:
    """M_B per global stage for one microbatch: its layers, and the stages' extras.

    First stage: the int64 token ids (8 bytes per token), with learned positions the
    position ids (8 per position), and with dropout the embedding's mask (h bytes per
    token). Last stage: the final norm's input, statistics and output (the head GEMM's
    input), 2*h*e + n*f per token (n = 2 for LayerNorm, 1 for RMSNorm), and the loss
    (`loss_activation_bytes`), tied head or not. Every stage, with rotary positions: the
    cos and sin tables (`rotary_table_bytes`)."""
    s, b, h = config.seq, config.microbatch_size, config.hidden
    e, f = config.dtype_bytes, max(4, config.dtype_bytes)
    layer = layer_activation_bytes(config, s, s)
    embed = 8 * s * b + (8 * s if config.positions == "learned" else 0) + (s * b * h if config.dropout else 0)
    head = s * b * (2 * h * e + _NORM_STATISTICS[config.norm] * f) + loss_activation_bytes(config)
    return _stage_sums(config, num_stages, layer, embed, head)


def _stage_sums(config: TransformerConfig, num_stages: int, layer: float, embed: float, head: float) -> tuple[float, ...]:
    """Per global stage: its layers at `layer` bytes each and the rotary tables, plus `embed` on
    the first stage and `head` on the last (`stage_activation_bytes`, and tp_memory's at tp > 1)."""
    rotary, last = rotary_table_bytes(config), num_stages - 1
    return tuple(n * layer + rotary + (embed if i == 0 else 0) + (head if i == last else 0)
                 for i, n in enumerate(config.stage_layers(num_stages)))


def w_elements(config: TransformerConfig) -> int:
    """Elements per token a layer's W needs kept after B: its GEMMs' inputs (the first norm's
    output, the attention output, the second norm's output, the down product's input:
    2h + a*d + f_m) and output gradients (q, k, v, the out projection, the MLP's up (and
    gate) and down products: a*d + 2*k*d + 2h + (m - 1)*f_m). 16h for the GPT."""
    shape = config.shape
    return 4 * config.hidden + 2 * shape.q_width + 2 * shape.kv_width + shape.mlp_matrices * shape.ffn_width


def transformer_w_ratio(config: TransformerConfig) -> float:
    """M_W / M_B of a layer: what W needs kept after B, its GEMMs' inputs and output
    gradients (`w_elements` per token: 16*h*e for the GPT, the Zero Bubble paper's
    32*s*b*h in 16-bit bytes)."""
    s = config.seq
    return w_elements(config) * s * config.microbatch_size * config.dtype_bytes / layer_activation_bytes(config, s, s)


def layer_gemms(config: TransformerConfig, tp: int = 1) -> tuple[tuple[float, float], ...]:
    """The (inner, outer) sides of a layer's matrix products, each with s*b rows, on one of
    `tp` tensor-parallel ranks (the column-parallel products' outer side and the row-parallel
    ones' inner side divided by tp). The reference GPT (`TransformerConfig.fused_qkv`):
    q/k/v h x (a*d + 2*k*d) as one product, out a*d x h, MLP h x f_m and f_m x h; other
    shapes: q h x a*d, k and v h x k*d each, out a*d x h, and the MLP's gate and up h x f_m
    (SwiGLU) or up (GELU), down f_m x h."""
    shape = config.shape
    h, q, kv, f = config.hidden, shape.q_width, shape.kv_width, shape.ffn_width

    def part(width: int) -> float:
        return width if tp == 1 else width / tp

    if config.fused_qkv:
        attention = ((h, part(q + 2 * kv)), (part(q), h))
    else:
        attention = ((h, part(q)), (h, part(kv)), (h, part(kv)), (part(q), h))
    return attention + ((h, part(f)),) * (shape.mlp_matrices - 1) + ((part(f), h),)


def layer_intensity(config: TransformerConfig) -> float:
    """FLOPs per byte of a layer's matrix products (`layer_gemms`: for the GPT QKV h x 3h,
    projection h x h, MLP h x 4h and 4h x h, s*b rows each): their FLOPs over the bytes of
    their operands and results. F, B and W multiply the same three sides, so one intensity
    serves all three."""
    rows, e = config.seq * config.microbatch_size, config.dtype_bytes
    sides = layer_gemms(config)
    flops = sum(2 * rows * k * n for k, n in sides)
    return flops / (e * sum(rows * k + k * n + rows * n for k, n in sides))


def head_intensity(config: TransformerConfig) -> float:
    """FLOPs per byte of the LM head's s*b x h by h x V product."""
    rows, h, V, e = config.seq * config.microbatch_size, config.hidden, config.vocab, config.dtype_bytes
    return 2 * rows * h * V / (e * (rows * h + h * V + rows * V))


def transformer_costs(config: TransformerConfig, hardware: Hardware, *, num_stages: int,
                      stage0_input_grad: bool = False) -> Costs:
    """Per-stage costs (seconds, bytes) for `num_stages` global stages of `config`.

    Stage 0's B is 0 and its W the whole backward, as the runtime runs it (its input, token
    ids, needs no gradient); `stage0_input_grad=True` splits it like any other stage (with
    sequence chunks, whose earlier K/V need their gradient in B)."""
    peak = hardware.flops
    layer_i, head_i = layer_intensity(config), head_intensity(config)
    layer = layer_flops(config)  # F, B, W
    head = head_flops(config)
    counts = config.stage_layers(num_stages)
    last = num_stages - 1
    # the softmax cross entropy: memory-bound, in F and B (its W is the head's GEMM alone)
    loss = (*cross_entropy_bytes(config), 0.0)
    bandwidth = hardware.memory_bandwidth

    def time(kind: int, stage: int) -> float:
        n = counts[stage]
        seconds = n * (layer[kind] / (peak * hardware.fraction(kind, layer_i)) + hardware.overhead(kind))
        if stage == 0:
            seconds += hardware.overhead(kind, "embedding")
        if stage == last:
            seconds += head / (peak * hardware.fraction(kind, head_i)) + hardware.overhead(kind, "head")
            if bandwidth is not None:
                seconds += loss[kind] / bandwidth
        return seconds

    t_f, t_b, t_w = (tuple(time(kind, i) for i in range(num_stages)) for kind in range(3))
    mem_b = stage_activation_bytes(config, num_stages)
    t_comm = hardware.latency + config.hidden_bytes / hardware.bandwidth
    # a recomputed stage keeps only its input, one hidden state per token
    kept = tuple(min(1.0, config.hidden_bytes / m) if m > 0 else 1.0 for m in mem_b)
    costs = Costs(
        recompute_input_ratio=kept,
        t_f=t_f, t_b=t_b, t_w=t_w, t_comm=t_comm, mem_b=mem_b, mem_w_ratio=transformer_w_ratio(config),
        params=tuple(float(n) for n in stage_params(config, num_stages)),
        # what an overlapped pair hides, per stage: the declared share of its shorter part
        overlap=tuple(hardware.overlap * min(f, b + w) for f, b, w in zip(t_f, t_b, t_w)) if hardware.overlap else 0.0,
    )
    return costs if stage0_input_grad else stage0_backward_in_w(costs)


def stage0_backward_in_w(costs: Costs) -> Costs:
    """`costs` (per-stage tuples) with stage 0's B folded into its W: the runtime's split on
    a stage whose input needs no gradient."""
    t_b, t_w = list(costs.t_b), list(costs.t_w)
    t_b[0], t_w[0] = 0.0, t_b[0] + t_w[0]
    return dataclasses.replace(costs, t_b=tuple(t_b), t_w=tuple(t_w))


def parse_model(text: str) -> TransformerConfig:
    """A preset name (`MODELS`: 1.5b, 6.2b, 14.6b, 28.3b, 9.6b, 21b, 38.5b, 98.5b, llama-3-8b,
    llama-3-70b, qwen2.5-7b) or 'LAYERS,HIDDEN,HEADS,SEQ[,VOCAB[,MICROBATCH]]' (a GPT)."""
    if text in MODELS:
        return MODELS[text]
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not 4 <= len(values) <= 6:
        raise ScheduleError(
            f"--model {text!r}: give a preset ({', '.join(MODELS)}) or LAYERS,HIDDEN,HEADS,SEQ[,VOCAB[,MICROBATCH]]"
        )
    names = ("layers", "hidden", "heads", "seq", "vocab", "microbatch_size")
    return TransformerConfig(**dict(zip(names, values)))


HF_SEQ = 4096
"""The training sequence of a `--hf` model when none is given: its context, at most this."""


def model_from_hf(path: str, *, seq: int | None = None, microbatch_size: int = 1, dtype: str = "bf16",
                  flash_attention: bool = False, dropout: bool = False) -> TransformerConfig:
    """The config that prices the Hugging Face model whose directory (or config.json) is
    `path` (`core.cost.hf_config.read_hf_config`: an architecture pipeblocks does not train, or a
    path without a config.json, is a ValueError saying so), trained on `seq`-token
    sequences (None: min(context, HF_SEQ), the context being max_position_embeddings).
    A sliding attention window (Mistral) is priced as full causal attention."""
    shape = read_hf_config(path).shape
    if seq is None:
        seq = min(shape.context or HF_SEQ, HF_SEQ)
    return TransformerConfig.from_shape(shape, seq=seq, microbatch_size=microbatch_size, dtype=dtype,
                                        flash_attention=flash_attention, dropout=dropout)
