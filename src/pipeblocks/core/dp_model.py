"""The data-parallel cost model: collective times on a link, and static memory by policy.

Ring collectives over d replicas, a payload of n bytes, a link of bandwidth bw and
per-step latency a (each ring step pays a once)::

    all-reduce       2(d-1)/d * n/bw + 2(d-1)*a
    reduce-scatter    (d-1)/d * n/bw +  (d-1)*a
    all-gather        (d-1)/d * n/bw +  (d-1)*a       (n: the full, gathered size)

What each op moves, for a stage of P parameters (bytes per element from the precision):

    policy     REDUCE_GRAD                 UNSHARD            after the optimizer step
    replicate  all-reduce of gradients     -                  -
    zero1      all-reduce of gradients     -                  all-gather of parameters
    zero2      reduce-scatter of gradients -                  all-gather of parameters
    zero3      reduce-scatter of gradients all-gather of      -
                                           parameters

zero1 and zero2 keep full parameters but each replica updates only its shard, so the
updated parameters are gathered once after the step (torch's ZeroRedundancyOptimizer; FSDP2
without resharding after forward gathers them at the next step's first forward instead, the
same volume). The simulator counts that gather at the end of the step, where nothing
overlaps it.

Static bytes per parameter (parameter + gradient + optimizer state), sharded by policy:
fp32 AdamW is 4 + 4 + 8 = 16; mixed precision is 2 + 2 + 12 (bf16 parameter and gradient,
fp32 master copy and moments)::

    replicate  p + g + o            (16)
    zero1      p + g + o/d          (8 + 8/d)
    zero2      p + (g + o)/d        (4 + 12/d)
    zero3      (p + g + o)/d        (16/d)

Inside the step the rank holds more (the static memory at the step's peak, `static_peak_bytes`):
gradients accumulate at full size over the microbatches until the stage's REDUCE_GRAD, and
a sharded stage's parameters are gathered for all of its passes (FSDP2: zero2 from its
first pass to its REDUCE_GRAD, zero3 from its UNSHARD to its RESHARD), beside the shard
the replica keeps. At the peak, per parameter::

    replicate  p + g + o       zero1  p + g + o/d      zero2, zero3  p + p/d + g + o/d

so sharding saves optimizer state at the peak, and parameters and gradients only between
steps (which is where a checkpoint or another model lives). These are the holdings of
`core.static_memory` (which follows torch's FSDP2 and ZeroRedundancyOptimizer) for a stage
whose parameters split evenly: no dim-0 padding, zero1's partition even. The textbook
ZeRO-2 peak, p + g + o/d, leaves out the shard FSDP2 keeps beside the gathered parameters.

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

from .sharding import ShardingPolicy, per_stage

__all__ = [
    "PRECISIONS", "UNIT_LINK", "DPCostModel", "Link", "Precision", "all_gather_time", "all_reduce_time",
    "reduce_scatter_time", "static_bytes", "static_peak_bytes",
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
    """Bytes per parameter of the parameter, its gradient and the optimizer state."""

    name: str
    param: float
    grad: float
    optim: float

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optim


PRECISIONS = {
    "fp32": Precision("fp32", 4, 4, 8),
    "mixed": Precision("mixed", 2, 2, 12),
}


def all_reduce_time(size: float, d: int, link: Link) -> float:
    return 0.0 if d <= 1 else 2 * (d - 1) / d * size / link.bandwidth + 2 * (d - 1) * link.latency


def reduce_scatter_time(size: float, d: int, link: Link) -> float:
    return 0.0 if d <= 1 else (d - 1) / d * size / link.bandwidth + (d - 1) * link.latency


all_gather_time = reduce_scatter_time  # the same ring, run the other way


def static_bytes(params: float, policy: ShardingPolicy, d: int, precision: Precision) -> float:
    """Parameter, gradient and optimizer-state bytes one replica holds for `params` parameters."""
    p, g, o = precision.param, precision.grad, precision.optim
    if policy is ShardingPolicy.REPLICATE:
        per = p + g + o
    elif policy is ShardingPolicy.ZERO1:
        per = p + g + o / d
    elif policy is ShardingPolicy.ZERO2:
        per = p + (g + o) / d
    else:
        per = (p + g + o) / d
    return params * per


def static_peak_bytes(params: float, policy: ShardingPolicy, d: int, precision: Precision) -> float:
    """Static bytes at the step's peak: full-size accumulated gradients before the
    reduction and, for zero2 and zero3 (FSDP2), the gathered parameters beside the rank's
    own shard; evenly split (no padding, zero1's partition even)."""
    p, g, o = precision.param, precision.grad, precision.optim
    if policy is ShardingPolicy.REPLICATE:
        per = p + g + o
    elif policy is ShardingPolicy.ZERO1:
        per = p + g + o / d
    else:
        per = p + p / d + g + o / d
    return params * per


@dataclass(frozen=True)
class DPCostModel:
    """The data-parallel side of the cost model: d replicas, a policy per chunk, the link
    and the precision."""

    dp: int = 1
    sharding: tuple[ShardingPolicy, ...] = (ShardingPolicy.REPLICATE,)
    link: Link = UNIT_LINK
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"--dp must be an integer >= 1, got {self.dp!r}: give 1 or more replicas")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        object.__setattr__(self, "sharding", tuple(ShardingPolicy(p) for p in self.sharding))

    @property
    def bytes(self) -> Precision:
        return PRECISIONS[self.precision]

    def policies(self, num_stages: int) -> tuple[ShardingPolicy, ...]:
        return per_stage(self.sharding, num_stages)

    def op_time(self, kind: str, params: float, policy: ShardingPolicy) -> float:
        """Duration of a DP op of a stage with `params` parameters on the link."""
        d, b = self.dp, self.bytes
        if kind == "UNSHARD":
            return all_gather_time(params * b.param, d, self.link)
        if kind == "REDUCE_GRAD":
            if policy in (ShardingPolicy.REPLICATE, ShardingPolicy.ZERO1):
                return all_reduce_time(params * b.grad, d, self.link)
            return reduce_scatter_time(params * b.grad, d, self.link)
        return 0.0  # RESHARD frees memory only

    def after_step_time(self, params: float, policy: ShardingPolicy) -> float:
        """The updated-parameter all-gather after the optimizer step (zero1, zero2)."""
        if policy in (ShardingPolicy.ZERO1, ShardingPolicy.ZERO2):
            return all_gather_time(params * self.bytes.param, self.dp, self.link)
        return 0.0

    def static_memory(self, stage_params: Iterable[float], stages: Iterable[int], *, peak: bool = False) -> float:
        """Static bytes one replica's rank holds for its `stages`: between steps (the
        textbook ZeRO figures, `static_bytes`), or (with `peak`) at the step's peak as
        FSDP2 and ZeroRedundancyOptimizer hold it (`static_peak_bytes`)."""
        params = tuple(stage_params)
        policy = self.policies(len(params))
        rule = static_peak_bytes if peak else static_bytes
        return sum(rule(params[s], policy[s], self.dp, self.bytes) for s in stages)
