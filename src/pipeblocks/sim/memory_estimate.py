"""Per-rank memory of a pipeline run, estimated from a model config alone: nothing is run
or profiled.

    >>> from pipeblocks.schedules import get
    >>> from pipeblocks.sim.analytic import TransformerConfig
    >>> from pipeblocks.sim.memory_estimate import estimate_memory
    >>> config = TransformerConfig(layers=8, hidden=64, heads=4, seq=64, vocab=256, microbatch_size=2,
    ...                            dtype="fp32", flash_attention=True, dropout=False)
    >>> estimate = estimate_memory(config, get("1f1b")(p=4, m=8), dp=2, sharding=("zero1",))
    >>> [round(r.total / 2**20, 1) for r in estimate.ranks]  # MiB per (pipeline rank, replica)
    [5.4, 5.4, 4.2, 4.2, 3.2, 3.2, 2.5, 2.5]

Per process (pipeline rank r, replica d) it gives:

* static bytes: parameters, gradients and AdamW state at the step's peak, as the sharding
  policies and the precision hold them (`core.cost.static_memory.predict_static_peak` over the
  lowered Program, with the model's parameter shapes per stage: FSDP2's padded
  shards, the zero1 partition of whole tensors; under bf16-mixed the float32 masters,
  gradients and state, and the bfloat16 compute copy or FSDP2's bfloat16 gathered
  parameters: 18 bytes per parameter at replicate);
* activation bytes: the simulator's peak of saved activations for the schedule, fed the
  analytic M_B per stage (`analytic.stage_activation_bytes`: layers, embedding ids on the
  first stage, final norm and loss on the last) and M_W as the runtime keeps it (B
  frees only the loss: the split backward keeps the rest of the graph for W; `w_keeps`
  "weights" takes the Zero Bubble paper's M_W instead), at the precision's compute dtype
  (bf16-mixed: 2 bytes per element). Sequence chunks take their share
  from `sequence_split.chunk_shares`; a recomputed forward (`1f1b-r`) keeps its input;
* total = static + activation: the sum of the two peaks, as `pipeblocks train` reports
  them (measured apart), so an upper bound of the joint peak.

What is left out: allocator granularity and caching, the executor's buffers outside the
autograd graph (stage outputs until their backward, received gradients, send buffers),
FSDP2's communication buffers, AdamW's step counters (4 bytes per tensor), the optimistic
step's spare copies.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.cost.costs import Costs
from ..core.cost.dp_model import resolve_precision, w_gradients_wait
from ..core.lowering.entry import lower_for
from ..core.cost.precision import PRECISION_NAMES, PrecisionPolicy
from ..core.ir.schedule import Schedule
from ..core.ir.sharding import ShardingPolicy, parse_sharding, per_stage
from ..core.simulator.simulate import simulate
from ..core.cost.static_memory import chunk_bytes, predict_static_peak
from .analytic import (
    TransformerConfig, layer_activation_bytes, loss_activation_bytes, stage_activation_bytes,
    transformer_w_ratio,
)
from .sequence_split import SPLITS, chunk_shares, split_lengths
from .tp_memory import tp_stage_activation_bytes, tp_stage_param_shapes

__all__ = [
    "RankMemory", "MemoryEstimate", "estimate_memory", "stage_param_shapes", "activation_costs", "rank_static_peak",
    "precision_config", "PRECISION_CHOICES", "W_KEEPS",
]

# also the names `dp_model.resolve_precision` takes: "mixed", "float32", "float64", "bf16"
PRECISION_CHOICES = ("auto", *PRECISION_NAMES)
W_KEEPS = ("graph", "weights")


@dataclass(frozen=True)
class RankMemory:
    """One process's estimate, in bytes."""

    rank: int
    """pipeline rank"""
    dp_rank: int
    """data-parallel replica"""
    stages: tuple[int, ...]
    static_bytes: float
    """parameters, gradients and optimizer state at the step's peak"""
    activation_bytes: float
    """peak saved activations over the step"""

    @property
    def total(self) -> float:
        return self.static_bytes + self.activation_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-process estimates (pipeline rank major, replica minor) and the per-stage inputs."""

    ranks: tuple[RankMemory, ...]
    stage_activation: tuple[float, ...]
    """M_B: what one microbatch's forward saves, per global stage"""
    stage_params: tuple[int, ...]
    """parameters per global stage"""

    @property
    def peak(self) -> float:
        """The largest total over the processes: what must fit on one device."""
        return max(r.total for r in self.ranks)

    def rank(self, rank: int, dp_rank: int = 0) -> RankMemory:
        """The estimate of pipeline rank `rank`, replica `dp_rank`."""
        for r in self.ranks:
            if r.rank == rank and r.dp_rank == dp_rank:
                return r
        p, dp = max(r.rank for r in self.ranks) + 1, max(r.dp_rank for r in self.ranks) + 1
        raise ValueError(f"no process (rank {rank}, replica {dp_rank}): ranks are 0..{p - 1}, replicas 0..{dp - 1}")


def stage_param_shapes(config: TransformerConfig, num_stages: int, tp: int = 1) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The trainable parameters' shapes per global stage, in module order, as the model holds
    them (`tp_memory.tp_stage_param_shapes`, which lists them; tp > 1: one tensor-parallel
    rank's share). The static memory sizes each tensor on its own (FSDP2 pads every tensor to
    its shards, zero1 partitions whole tensors), so the shapes, not only the count, decide it."""
    return tp_stage_param_shapes(config, num_stages, tp)


# TransformerConfig's name of a core.cost.precision dtype where the two differ
_CONFIG_DTYPE = {"bfloat16": "bf16"}


def precision_config(config: TransformerConfig, precision: str | PrecisionPolicy) -> tuple[TransformerConfig, PrecisionPolicy]:
    """The policy `precision` names, and `config` with activations in its compute dtype.

    "auto": the policy of the config's activation dtype (fp32, float64; a 16-bit dtype is
    bf16-mixed); any other name or policy, as `dp_model.resolve_precision` ("mixed" is
    bf16-mixed), and the config's dtype becomes the policy's compute dtype where their sizes
    differ (bf16-mixed: 2 bytes per activation element)."""
    if isinstance(precision, str) and precision == "auto":
        policy = resolve_precision({4: "fp32", 8: "fp64"}.get(config.dtype_bytes, "bf16-mixed"))
    else:
        try:
            policy = resolve_precision(precision)
        except ValueError:
            raise ValueError(
                f"precision {precision!r}: choose one of {', '.join(PRECISION_CHOICES)} (mixed: bf16-mixed)"
            ) from None
    if config.dtype_bytes != policy.compute_bytes:
        config = dataclasses.replace(config, dtype=_CONFIG_DTYPE.get(policy.compute, policy.compute))
    return config, policy


def _w_ratios(config: TransformerConfig, mem_b: tuple[float, ...], w_keeps: str) -> tuple[float, ...]:
    """M_W / M_B per stage: what B leaves for W."""
    S = len(mem_b)
    if w_keeps == "graph":
        # the runtime's split backward frees only the loss in B; W keeps the rest of the graph
        return tuple(1.0 - (loss_activation_bytes(config) / m if s == S - 1 else 0.0) for s, m in enumerate(mem_b))
    # W's GEMM inputs and output gradients per layer; the head's input and logit gradients
    # on the last stage; the token ids the embedding's gradient scatters by on the first
    tokens = config.seq * config.microbatch_size
    layer = transformer_w_ratio(config) * layer_activation_bytes(config, config.seq, config.seq)
    head = tokens * (config.hidden + config.vocab) * config.dtype_bytes
    needed = [n * layer + (8 * tokens if s == 0 else 0) + (head if s == S - 1 else 0)
              for s, n in enumerate(config.stage_layers(S))]
    return tuple(min(1.0, x / m) for x, m in zip(needed, mem_b))


def activation_costs(config: TransformerConfig, num_stages: int, seq_chunks: int = 1, *,
                     seq_split: str = "balanced", w_keeps: str = "graph", tp: int = 1) -> Costs:
    """The activation side of the cost model for `num_stages` global stages: M_B per stage,
    M_W / M_B as `w_keeps` says, what a recomputed forward keeps, and the sequence chunks'
    shares (`seq_chunks` > 1). `estimate_memory` simulates these; the planner takes them
    into its costs, so both peak at the same activation. tp > 1: what one tensor-parallel
    rank saves (`tp_memory.tp_stage_activation_bytes`); its stage input is its token shard."""
    if w_keeps not in W_KEEPS:
        raise ValueError(f"w_keeps {w_keeps!r}: choose one of {', '.join(W_KEEPS)}")
    if tp != 1 and seq_chunks > 1:
        raise ValueError(f"sequence chunks ({seq_chunks}) with tp {tp}: the runtime runs neither together; use one")
    S = num_stages
    mem_b = stage_activation_bytes(config, S) if tp == 1 else tp_stage_activation_bytes(config, S, tp)
    # a recomputed forward keeps its input: the token ids on the first stage, a hidden state elsewhere
    tokens = config.seq * config.microbatch_size
    inputs = [8 * tokens] + [config.hidden_bytes / tp] * (S - 1)
    recompute = tuple(min(1.0, x / m) for x, m in zip(inputs, mem_b))
    seq_mem = None
    k = seq_chunks
    if k > 1:
        if k > config.seq:
            raise ValueError(f"{k} sequence chunks of a {config.seq}-token sequence: use at most {config.seq} chunks")
        if seq_split not in SPLITS:
            raise ValueError(f"seq_split {seq_split!r}: choose one of {', '.join(SPLITS)}")
        seq_mem = chunk_shares(split_lengths(config.seq, k, seq_split, config), config)[1]
    return Costs(mem_b=mem_b, mem_w_ratio=_w_ratios(config, mem_b, w_keeps), seq_mem=seq_mem,
                 recompute_input_ratio=recompute)


def rank_static_peak(config: TransformerConfig, num_stages: int, stages: Sequence[int],
                     policies: Sequence[str | ShardingPolicy], *, dp: int, precision: str | PrecisionPolicy,
                     tp: int = 1, split_backward: bool = False) -> float:
    """Static bytes at the step's peak of a pipeline rank holding `stages`, the most over
    its `dp` replicas: what `estimate_memory` gives that rank.

    The model's shapes per stage (`stage_param_shapes`; one tensor-parallel rank's share when
    tp > 1: the projections and tables split, the norms and the row-parallel biases whole), as
    FSDP2 pads them and ZeroRedundancyOptimizer partitions them (`core.cost.static_memory`), in
    `precision` (`precision_config`). split_backward: the schedule runs W apart from B
    (`Schedule.has_split_backward`), which under mixed precision holds more on FSDP2
    chunks (`ChunkBytes.pending`).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}: give 1 or more tensor-parallel ranks")
    policies = per_stage(parse_sharding(list(policies)), num_stages)
    _, policy = precision_config(config, precision)
    shapes = stage_param_shapes(config, num_stages, tp)
    return float(max(
        sum(chunk_bytes(shapes[s], policy=policies[s], d=dp, dp_rank=d, precision=policy).step_peak(split_backward and w_gradients_wait(s))
            for s in stages)
        for d in range(dp)
    ))


def estimate_memory(
    config: TransformerConfig,
    schedule: Schedule,
    *,
    dp: int = 1,
    sharding: Sequence[str | ShardingPolicy] = ("replicate",),
    precision: str = "auto",
    seq_split: str = "balanced",
    w_keeps: str = "graph",
    tp: int = 1,
) -> MemoryEstimate:
    """Static, peak activation and total bytes of every process of `schedule` (p pipeline
    ranks, each on `dp` replicas, each split over `tp` tensor-parallel ranks) training
    `config` with AdamW.

    schedule: a built schedule (`pipeblocks.schedules.get(name)(p=..., m=..., **options)`);
        its stage count, placement, B/W split and sequence chunks are what count.
    sharding: one policy for every stage or one per stage (replicate, zero1, zero2, zero3).
    precision: "auto" (the config's activation dtype: fp32 or fp64 AdamW in that dtype,
        16-bit dtypes bf16-mixed), "fp32", "fp64", "bf16-mixed" ("mixed"), or a
        `core.cost.precision.PrecisionPolicy`; it prices the static bytes and sets the
        activations' dtype (`precision_config`).
    seq_split: sequence-chunk boundaries ("balanced" or "even"), as `train --seq-split`.
    w_keeps: what a split backward keeps from B until W: "graph" (pipeblocks' runtime: all
        the forward saved but the loss) or "weights" (only W's GEMM inputs and output
        gradients: 16*h*e per token and layer, the Zero Bubble paper's M_W, which
        `analytic.transformer_costs` applies to every stage; here the head's input and
        logit gradients on the last stage and the token ids on the first).
    tp: tensor-parallel ranks per stage; each process of a (rank, replica) holds and saves
        what `tp_memory` gives (the same on every tp rank, so one entry stands for all tp).
    """
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a built Schedule (schedules.get(name)(p=, m=)), got {type(schedule).__name__}")
    if w_keeps not in W_KEEPS:
        raise ValueError(f"w_keeps {w_keeps!r}: choose one of {', '.join(W_KEEPS)}")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be an integer >= 1, got {dp!r}: give 1 or more replicas")
    S = schedule.num_stages
    policies = per_stage(parse_sharding(list(sharding)), S)
    config, policy = precision_config(config, precision)
    shapes = stage_param_shapes(config, S, tp)
    params = tuple(sum(math.prod(shape) for shape in stage) for stage in shapes)
    costs = activation_costs(config, S, schedule.seq_chunks, seq_split=seq_split, w_keeps=w_keeps, tp=tp)
    activation = simulate(schedule, costs).peak_activation
    program = lower_for(schedule, policies=policies, dp=dp)
    ranks = []
    for r in range(schedule.p):
        mine = schedule.placement.stages_of(r)
        for d in range(dp):
            static = predict_static_peak(program, r, {s: shapes[s] for s in mine}, policies, dp=dp, dp_rank=d,
                                         precision=policy)
            ranks.append(RankMemory(r, d, tuple(mine), float(static), float(activation[r])))
    return MemoryEstimate(tuple(ranks), tuple(float(x) for x in costs.mem_b), params)
