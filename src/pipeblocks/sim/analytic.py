"""An analytic transformer cost model: pass times and activation bytes per stage from a
model config and a hardware profile.

Per transformer layer, with s = sequence, b = microbatch size, h = hidden, a = heads
(FLOPs from the Zero Bubble paper, Table 1)::

    F = s*b*h*(24h + 4s)    B = s*b*h*(24h + 8s)    W = 24*s*b*h^2        (so B + W = 2F)

Activation bytes (what autograd saves for the backward; `layer_activation_bytes`, the
terms are listed there and in docs/memory.md) are, with dropout and 16-bit activations,
M_B = s*b*(34h + 5*a*s) as in Megatron's accounting (Korthikanti et al. 2022), plus the
LayerNorm statistics; with flash attention the s x s scores are not stored and a
log-sum-exp per query and head is (M_B = 34*s*b*h + 4*a*s*b + 16*s*b). M_W = 32*s*b*h.

Each layer also costs stage-level terms (`stage_activation_bytes`): the LM head on the last
stage (layers per stage follow `core.split.layer_counts`, which gives the end stages the
lighter share of an uneven split) adds 2*s*b*h*V FLOPs to each of F, B and W and saves the
final LayerNorm's input and output and the loss's log-probabilities (fp32, s*b*V*4 bytes);
the embedding on the first stage saves the token and position ids. Time = FLOPs / (peak
FLOP/s * achievable fraction); one hop between ranks takes latency + s*b*h*dtype_bytes /
bandwidth.

Parameters per stage (they size the data-parallel collectives and the static memory), as
the reference GPT has them: 12h^2 + 13h per layer, the embeddings (V + s)*h on the first
stage, the final LayerNorm and the untied head 2h + h*V on the last.

Data-parallel link: the mesh orders ranks (pp, dp), so a stage's d replicas are
consecutive ranks and share a node when d <= gpus_per_node; a ring that leaves the node
runs at the inter-node link (`dp_link`).

    >>> from pipeblocks.sim.analytic import MODELS, HARDWARE, transformer_costs
    >>> costs = transformer_costs(MODELS["1.5b"], HARDWARE["a100"], num_stages=8)
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType

from ..core.errors import ScheduleError
from ..core.costs import Costs
from ..core.dp_model import Link
from ..core.split import layer_counts

__all__ = [
    "TransformerConfig", "Hardware", "MODELS", "HARDWARE", "layer_split", "layer_activation_bytes", "transformer_costs",
    "parse_model", "stage_params", "dp_link", "stage_activation_bytes", "loss_activation_bytes",
    "transformer_w_ratio", "PassEfficiency", "layer_intensity", "head_intensity", "stage0_backward_in_w",
]

_DTYPE_BYTES = MappingProxyType({"fp32": 4, "float32": 4, "bf16": 2, "fp16": 2, "float16": 2, "float64": 8})


@dataclass(frozen=True)
class TransformerConfig:
    """A GPT-style decoder.

    layers, hidden, heads: the transformer stack.
    seq: tokens per sequence.  vocab: vocabulary (padded).  microbatch_size: sequences per microbatch.
    dtype: activation dtype name (bf16, fp16, fp32, float64).
    flash_attention: attention that does not store the s x s scores (drops the 5*a*s term
        of M_B and keeps a log-sum-exp per query and head instead), as long-sequence
        training and torch's scaled_dot_product_attention do.
    dropout: the model trains with dropout, whose masks are saved for the backward (one
        byte per element: after attention, after the MLP, on the embedding, and on the
        attention probabilities unless flash attention). Megatron's accounting has it; the
        reference GPT of `pipeblocks train` has no dropout.
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

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab", "microbatch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"model {name} must be an integer >= 1, got {value!r}")
        if self.hidden % self.heads:
            raise ScheduleError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.dtype not in _DTYPE_BYTES:
            raise ScheduleError(f"unknown dtype {self.dtype!r}; choose one of {sorted(_DTYPE_BYTES)}")

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class PassEfficiency:
    """The achievable fraction of the peak for one pass kind, as a function of the arithmetic
    intensity I (FLOPs per byte) of the pass's matrix products: ceiling / (1 + ridge / I),
    the planner's roofline form (`plan.intensity`); ridge 0 is a constant fraction."""

    ceiling: float
    ridge: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ceiling) and math.isfinite(self.ridge) and self.ceiling > 0 and self.ridge >= 0):
            raise ScheduleError(f"pass efficiency needs a finite ceiling > 0 and ridge >= 0, got ceiling="
                                f"{self.ceiling}, ridge={self.ridge}")

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
        used instead of `efficiency` for the pass times; None for the built-in profiles.
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

    def __post_init__(self) -> None:
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
    """Parameters per stage: layers, embeddings on the first stage, the head on the last."""
    h, V, s = config.hidden, config.vocab, config.seq
    layer = 12 * h * h + 13 * h
    counts = layer_split(config.layers, num_stages)
    last = num_stages - 1
    return tuple(
        n * layer + ((V + s) * h if i == 0 else 0) + ((2 * h + h * V) if i == last else 0)
        for i, n in enumerate(counts)
    )


def layer_split(layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage: the model splitter's rule (`core.split.layer_counts`), so the
    analytic costs describe the stages the runtime builds."""
    return layer_counts(layers, num_stages)


def layer_activation_bytes(config: TransformerConfig, tokens: int, keys: int, *, kv: bool = True) -> float:
    """Bytes one layer's forward saves for `tokens` queries attending over `keys` keys, per
    microbatch. Per token, with e the activation element size and f = max(4, e) the size of
    the statistics kept in fp32 at least (a pre-norm block, MLP 4h, GELU)::

        16*h*e   the block input, LayerNorm 1's output (the QKV GEMM's input), Q, K and V
                 (one 3h tensor), the attention output (the projection's input), the
                 residual after attention, LayerNorm 2's output, the MLP's 4h GEMM output
                 (GELU's input) and GELU's 4h output (the second GEMM's input)
        4*f      mean and reciprocal deviation of both LayerNorms
        a*f      flash attention: one log-sum-exp per head;  else  a*keys*e  probabilities
        dropout: 2*h (masks after attention and after the MLP, a byte each), and without
                 flash attention a*keys*(1 + e) (the probabilities' mask and dropped copy)

    With dropout and 16-bit activations this is Megatron's 34*h + 5*a*s (plus 16 bytes).
    kv=False leaves K and V out (2*h*e: a sequence chunk's K/V live in a buffer of the
    whole sequence)."""
    b, h, a = config.microbatch_size, config.hidden, config.heads
    e = config.dtype_bytes
    f = max(4, e)
    per_token = (16 if kv else 14) * h * e + 4 * f
    per_token += a * f if config.flash_attention else a * keys * e
    if config.dropout:
        per_token += 2 * h + (0 if config.flash_attention else a * keys * (1 + e))
    return tokens * b * per_token


def loss_activation_bytes(config: TransformerConfig) -> float:
    """What the loss saves on the last stage per microbatch, freed by its backward (B):
    the log-probabilities (fp32 at least, s*b*V*f), the int64 targets and one scalar."""
    tokens = config.seq * config.microbatch_size
    return tokens * (config.vocab * max(4, config.dtype_bytes) + 8) + config.dtype_bytes


def stage_activation_bytes(config: TransformerConfig, num_stages: int) -> tuple[float, ...]:
    """M_B per global stage for one microbatch: its layers, and the end stages' extras.

    First stage: the int64 token ids (8 bytes per token) and position ids (8 per position),
    and with dropout the embedding's mask (h bytes per token). Last stage: the final
    LayerNorm's input, statistics and output (the head GEMM's input), 2*h*e + 2*f per
    token, and the loss (`loss_activation_bytes`)."""
    s, b, h = config.seq, config.microbatch_size, config.hidden
    e, f = config.dtype_bytes, max(4, config.dtype_bytes)
    layer = layer_activation_bytes(config, s, s)
    embed = 8 * s * b + 8 * s + (s * b * h if config.dropout else 0)
    head = s * b * (2 * h * e + 2 * f) + loss_activation_bytes(config)
    last = num_stages - 1
    return tuple(
        n * layer + (embed if i == 0 else 0) + (head if i == last else 0)
        for i, n in enumerate(layer_split(config.layers, num_stages))
    )


def transformer_w_ratio(config: TransformerConfig) -> float:
    """M_W / M_B of a layer: what W needs kept after B, its GEMMs' inputs and output
    gradients (16*h*e per token, the Zero Bubble paper's 32*s*b*h in 16-bit bytes)."""
    s = config.seq
    return 16 * s * config.microbatch_size * config.hidden * config.dtype_bytes / layer_activation_bytes(config, s, s)


def layer_intensity(config: TransformerConfig) -> float:
    """FLOPs per byte of a layer's four matrix products (QKV h x 3h, projection h x h, MLP
    h x 4h and 4h x h, s*b rows each): their FLOPs over the bytes of their operands and
    results. F, B and W multiply the same three sides, so one intensity serves all three."""
    rows, h, e = config.seq * config.microbatch_size, config.hidden, config.dtype_bytes
    sides = ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h))
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
    s, b, h, V = config.seq, config.microbatch_size, config.hidden, config.vocab
    peak = hardware.flops
    layer_i, head_i = layer_intensity(config), head_intensity(config)
    layer = (s * b * h * (24 * h + 4 * s), s * b * h * (24 * h + 8 * s), 24 * s * b * h * h)  # F, B, W
    head = 2 * s * b * h * V
    counts = layer_split(config.layers, num_stages)
    last = num_stages - 1

    def time(kind: int, stage: int) -> float:
        n = counts[stage]
        seconds = n * layer[kind] / (peak * hardware.fraction(kind, layer_i))
        if stage == last:
            seconds += head / (peak * hardware.fraction(kind, head_i))
        return seconds

    t_f, t_b, t_w = (tuple(time(kind, i) for i in range(num_stages)) for kind in range(3))
    mem_b = stage_activation_bytes(config, num_stages)
    t_comm = hardware.latency + s * b * h * config.dtype_bytes / hardware.bandwidth
    # a recomputed stage keeps only its input, one hidden state per token
    kept = tuple(min(1.0, s * b * h * config.dtype_bytes / m) if m > 0 else 1.0 for m in mem_b)
    costs = Costs(
        recompute_input_ratio=kept,
        t_f=t_f, t_b=t_b, t_w=t_w, t_comm=t_comm, mem_b=mem_b, mem_w_ratio=transformer_w_ratio(config),
        params=tuple(float(n) for n in stage_params(config, num_stages)),
    )
    return costs if stage0_input_grad else stage0_backward_in_w(costs)


def stage0_backward_in_w(costs: Costs) -> Costs:
    """`costs` (per-stage tuples) with stage 0's B folded into its W: the runtime's split on
    a stage whose input needs no gradient."""
    t_b, t_w = list(costs.t_b), list(costs.t_w)
    t_b[0], t_w[0] = 0.0, t_b[0] + t_w[0]
    return dataclasses.replace(costs, t_b=tuple(t_b), t_w=tuple(t_w))


def parse_model(text: str) -> TransformerConfig:
    """A preset name (1.5b, 6.2b, 14.6b, 28.3b, 9.6b, 21b, 38.5b, 98.5b) or 'LAYERS,HIDDEN,HEADS,SEQ[,VOCAB[,MICROBATCH]]'."""
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
