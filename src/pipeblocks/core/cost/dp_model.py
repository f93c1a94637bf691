"""The data-parallel cost model: collective times on a link, and static memory by policy.

Ring collectives over d replicas, a payload of n bytes, a link of bandwidth bw and
per-step latency a (each ring step pays a once)::

    all-reduce       2(d-1)/d * n/bw + 2(d-1)*a
    reduce-scatter    (d-1)/d * n/bw +  (d-1)*a
    all-gather        (d-1)/d * n/bw +  (d-1)*a       (n: the full, gathered size)

What each op moves, for a stage of P parameters (bytes per element from the precision,
`Precision`: m master, c compute, g gradient)::

    policy     REDUCE_GRAD                      UNSHARD                  after the optimizer step
    replicate  all-reduce of gradients (g)      -                        -
    zero1      all-reduce of gradients (g)      -                        masters (m)
    zero2      reduce-scatter of gradients (g)  -                        gather of parameters (c)
    zero3      reduce-scatter of gradients (g)  all-gather of            -
                                                parameters (c)
    zero3-regather  as zero3, with one all-gather per visit of the chunk (`passes_dp`)

zero1 and zero2 keep full parameters but each replica updates only its shard, so the
updated parameters are gathered once after the step: torch's ZeroRedundancyOptimizer
broadcasts the masters it updated; FSDP2 without resharding after forward gathers the
compute-dtype parameters at the next step's first pass instead. The simulator counts that
gather at the end of the step, where nothing overlaps it. Under bf16-mixed gradients are
reduced in float32 (g = 4) and parameters gathered in bfloat16 (c = 2).

Bytes per parameter (`Precision`, from `core.cost.precision.PrecisionPolicy`; AdamW, two moments
in the master dtype)::

    precision   master m  copy k  gathered c  gradient g  optimizer o
    fp32        4         0       4           4           8
    fp64        8         0       8           8           16
    bf16-mixed  4         2       2           4           8

k is the compute copy of a chunk FSDP2 does not shard (replicate, zero1): the runtime casts
the masters once at the step's start and drops the copy at its end; zero2 and zero3 hold
FSDP2's gathered parameters (c) instead. "mixed" names bf16-mixed here (the planner's and
the simulator's `--mixed-precision`).

Static bytes between steps (parameters, gradients, optimizer state; no copies and nothing
gathered), the textbook ZeRO figures, `static_bytes` (fp32 and bf16-mixed alike: 4 + 4 + 8;
FSDP2's zero2 holds less, its parameters sharded)::

    replicate  m + g + o            (16)
    zero1      m + g + o/d          (8 + 8/d)
    zero2      m + (g + o)/d        (4 + 12/d)
    zero3      (m + g + o)/d        (16/d)

Inside the step the rank holds more (the static memory at the step's peak, `static_peak_bytes`):
gradients accumulate at full size over the microbatches until the stage's REDUCE_GRAD, a
chunk FSDP2 does not shard holds its compute copy, and a sharded stage's parameters are
gathered for all of its passes (FSDP2: zero2 from its first pass to its REDUCE_GRAD, zero3
from its UNSHARD to its RESHARD), beside the shard the replica keeps. At the peak, per
parameter::

    policy        formula              fp32          bf16-mixed
    replicate     m + k + g + o        16            18
    zero1         m + k + g + o/d      8 + 8/d       10 + 8/d
    zero2, zero3  m/d + c + g + o/d    8 + 12/d      6 + 12/d
    (and zero3-regather)

so sharding saves optimizer state at the peak, and parameters and gradients only between
steps (which is where a checkpoint or another model lives). zero3-regather holds what
zero3 holds, but its gathered parameters (c) only during the chunk's visits: the formula
above counts them at the peak all the same (`static_peak_bytes`), and the simulator traces
them over time beside the activations (`Timeline.memory_peak`), taking `gathered_bytes`
off this figure for each such chunk. These are the holdings of
`core.cost.static_memory` (which follows torch's FSDP2 and ZeroRedundancyOptimizer) for a stage
whose parameters split evenly: no dim-0 padding, zero1's partition even. The textbook
ZeRO-2 peak, m + g + o/d, leaves out the shard FSDP2 keeps beside the gathered parameters;
the ZeRO paper's mixed precision (2 + 2 + 12: fp16 parameters and gradients) is not what
the runtime holds, which accumulates and reduces gradients in float32.

Units. Under the analytic model, sizes are bytes and times seconds: --dp-bandwidth is in
GB/s and --dp-latency in microseconds. Under unit costs (no --model) a full stage holds one
unit of parameters, so sizes are in "bytes per parameter" units (16 per full stage for
fp32 replicate) and the link moves `bandwidth` such units per time unit; the default unit
link (4 per time unit, no latency) moves one full stage's fp32 gradients in one T_F.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..ir.dp_units import check_dp_unit, check_prefetch
from .precision import PRECISION_NAMES, PrecisionPolicy, precision_policy
from ..ir.sharding import ShardingPolicy, per_stage

__all__ = [
    "PRECISIONS", "UNIT_LINK", "DPCostModel", "Link", "Precision", "all_gather_time", "all_reduce_time",
    "gathered_bytes", "precision_bytes", "reduce_scatter_time", "resolve_precision", "static_bytes",
    "static_peak_bytes", "w_gradients_wait",
]


def _finite(name: str, value: float, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")


@dataclass(frozen=True)
class Link:
    """A data-parallel link: bandwidth (size units per time unit) and latency per ring step."""

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        _finite("DP link bandwidth", self.bandwidth, positive=True)
        _finite("DP link latency", self.latency, positive=False)


UNIT_LINK = Link(bandwidth=4.0, latency=0.0)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter a rank holds and moves under one training precision, derived from
    its `core.cost.precision.PrecisionPolicy` (`Precision.of`)."""

    name: str
    master: float
    """the parameter kept and updated (its shard, where FSDP2 shards it)"""
    copy: float
    """the compute copy a chunk FSDP2 does not shard holds during the step (0: it computes
    with the masters)"""
    gathered: float
    """a parameter FSDP2 gathers for the passes (the compute dtype)"""
    grad: float
    """the gradient, accumulated over the microbatches and reduced in this size"""
    optim: float
    """AdamW's two moments"""

    @classmethod
    def of(cls, policy: PrecisionPolicy) -> Precision:
        return cls(policy.name, policy.master_bytes, policy.compute_bytes if policy.mixed else 0,
                   policy.compute_bytes, policy.grad_bytes, policy.optimizer_bytes)

    @property
    def total(self) -> float:
        """Bytes per parameter between steps, unsharded: master, gradient and optimizer state."""
        return self.master + self.grad + self.optim


PRECISIONS = {name: Precision.of(precision_policy(name)) for name in PRECISION_NAMES}
# the planner's and the simulator's name for the one mixed precision the runtime runs
_ALIASES = {"mixed": "bf16-mixed"}


def resolve_precision(precision: str | PrecisionPolicy) -> PrecisionPolicy:
    """The policy of `precision`: a policy, or its name ("fp32", "fp64", "bf16-mixed"; "mixed"
    is bf16-mixed; the old dtype names "float32", "float64", "bf16" too)."""
    if isinstance(precision, PrecisionPolicy):
        return precision
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a name or a PrecisionPolicy, got {type(precision).__name__}")
    try:
        return precision_policy(_ALIASES.get(precision, precision))
    except ValueError:
        raise ValueError(
            f"precision {precision!r}: choose one of {', '.join(PRECISION_NAMES)} (mixed: bf16-mixed)"
        ) from None


def precision_bytes(precision: str | PrecisionPolicy) -> Precision:
    """The bytes per parameter of `precision` (a policy or a name, as `resolve_precision`)."""
    return Precision.of(resolve_precision(precision))


def all_reduce_time(size: float, d: int, link: Link) -> float:
    return 0.0 if d <= 1 else 2 * (d - 1) / d * size / link.bandwidth + 2 * (d - 1) * link.latency


def reduce_scatter_time(size: float, d: int, link: Link) -> float:
    return 0.0 if d <= 1 else (d - 1) / d * size / link.bandwidth + (d - 1) * link.latency


all_gather_time = reduce_scatter_time  # the same ring, run the other way


def static_bytes(params: float, policy: ShardingPolicy, d: int, precision: Precision) -> float:
    """Parameter, gradient and optimizer-state bytes one replica holds for `params` parameters
    between steps (the textbook ZeRO figures)."""
    m, g, o = precision.master, precision.grad, precision.optim
    if policy is ShardingPolicy.REPLICATE:
        per = m + g + o
    elif policy is ShardingPolicy.ZERO1:
        per = m + g + o / d
    elif policy is ShardingPolicy.ZERO2:
        per = m + (g + o) / d
    else:
        per = (m + g + o) / d
    return params * per


def gathered_bytes(params: float, policy: ShardingPolicy, precision: Precision) -> float:
    """The gathered parameters (compute dtype) a zero3 chunk of `params` parameters holds
    from its UNSHARD to its RESHARD (0 for a policy the Program does not gather)."""
    return params * precision.gathered if ShardingPolicy(policy).shards_parameters else 0.0


def w_gradients_wait(stage: int) -> bool:
    """Whether, under mixed precision, a split backward's W gradients of global `stage` wait
    on an FSDP2 chunk's gathered parameters for the chunk's next B (or its reduction): every
    stage but 0, whose input, the tokens, takes no gradient, so no backward reaches it and
    FSDP2's root callback folds its gradients at the end of each backward call."""
    return stage != 0


def static_peak_bytes(params: float, policy: ShardingPolicy, d: int, precision: Precision, *,
                      split_backward: bool = False) -> float:
    """Static bytes at the step's peak: full-size accumulated gradients before the
    reduction, the compute copy of a chunk FSDP2 does not shard (replicate, zero1) and, for
    zero2 and zero3 (FSDP2), the gathered parameters beside the rank's own shard; evenly
    split (no padding, zero1's partition even). split_backward: the schedule runs W apart
    from B, which under mixed precision leaves an FSDP2 chunk's compute-dtype gradients on
    its gathered parameters until the reduction (`core.cost.static_memory`)."""
    m, g, o = precision.master, precision.grad, precision.optim
    if policy is ShardingPolicy.REPLICATE:
        per = m + precision.copy + g + o
    elif policy is ShardingPolicy.ZERO1:
        per = m + precision.copy + g + o / d
    else:
        per = m / d + precision.gathered + g + o / d
        if split_backward and precision.gathered != g:
            per += precision.gathered
    return params * per


@dataclass(frozen=True)
class DPCostModel:
    """The data-parallel side of the cost model: d replicas, a policy per chunk, the link,
    the precision, and the grain of the collectives (`dp_units`)."""

    dp: int = 1
    sharding: tuple[ShardingPolicy, ...] = (ShardingPolicy.REPLICATE,)
    link: Link = UNIT_LINK
    precision: str = "fp32"
    """a `core.cost.precision` policy name ("mixed" or a PrecisionPolicy are taken and kept by name)"""
    unit: str = "chunk"
    """"chunk": one gather and one reduction per chunk; "block": one per block (`dp_units`),
    the blocks given by the costs (`Costs.blocks`; none given: one block per stage)"""
    prefetch: int | None = None
    """at block grain, how many of a zero3 chunk's units are gathered ahead of its first
    pass (None: all; k: the rest each when the pass reaches the unit k before it)"""

    def __post_init__(self) -> None:
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"--dp must be an integer >= 1, got {self.dp!r}: give 1 or more replicas")
        check_dp_unit(self.unit)
        check_prefetch(self.prefetch)
        object.__setattr__(self, "precision", resolve_precision(self.precision).name)
        object.__setattr__(self, "sharding", tuple(ShardingPolicy(p) for p in self.sharding))

    @property
    def bytes(self) -> Precision:
        return PRECISIONS[self.precision]

    def policies(self, num_stages: int) -> tuple[ShardingPolicy, ...]:
        return per_stage(self.sharding, num_stages)

    def op_time(self, kind: str, params: float, policy: ShardingPolicy) -> float:
        """Duration of a DP op of a stage with `params` parameters on the link."""
        d, b = self.dp, self.bytes
        if kind == "UNSHARD":  # FSDP2 gathers the compute dtype
            return all_gather_time(params * b.gathered, d, self.link)
        if kind == "REDUCE_GRAD":
            if policy in (ShardingPolicy.REPLICATE, ShardingPolicy.ZERO1):
                return all_reduce_time(params * b.grad, d, self.link)
            return reduce_scatter_time(params * b.grad, d, self.link)
        return 0.0  # RESHARD frees memory only

    def after_step_time(self, params: float, policy: ShardingPolicy) -> float:
        """The updated-parameter gather after the optimizer step: zero1's masters
        (ZeroRedundancyOptimizer broadcasts what each replica updated), zero2's compute-dtype
        parameters (FSDP2 gathers them at the next step's first pass)."""
        if policy is ShardingPolicy.ZERO1:
            return all_gather_time(params * self.bytes.master, self.dp, self.link)
        if policy is ShardingPolicy.ZERO2:
            return all_gather_time(params * self.bytes.gathered, self.dp, self.link)
        return 0.0

    def static_memory(self, stage_params: Iterable[float], stages: Iterable[int], *, peak: bool = False,
                      split_backward: bool = False) -> float:
        """Static bytes one replica's rank holds for its `stages`: between steps (the
        textbook ZeRO figures, `static_bytes`), or (with `peak`) at the step's peak as
        FSDP2 and ZeroRedundancyOptimizer hold it (`static_peak_bytes`; `split_backward`:
        the schedule runs W apart from B)."""
        params = tuple(stage_params)
        policy = self.policies(len(params))
        if not peak:
            return sum(static_bytes(params[s], policy[s], self.dp, self.bytes) for s in stages)
        return sum(static_peak_bytes(params[s], policy[s], self.dp, self.bytes,
                                     split_backward=split_backward and w_gradients_wait(s))
                   for s in stages)
