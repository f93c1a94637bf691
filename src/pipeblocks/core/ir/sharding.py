"""Data-parallel sharding policies, one per chunk (global stage).

    replicate  every replica holds parameters, gradients and optimizer state; gradients
               are all-reduced once per step
    zero1      optimizer state sharded over the d replicas (gradients still all-reduced)
    zero2      and gradients reduce-scattered (each replica keeps its shard)
    zero3      and parameters sharded: gathered (UNSHARD) before a chunk's passes, freed
               (RESHARD) after them: held gathered for the whole step
    zero3-regather
               zero3 whose parameters are also freed between the chunk's visits and
               gathered again before the next one (`passes_dp.add_sharding`): more gathers,
               less parameter memory inside the step. A visit is a run of the chunk's passes
               on its rank that at most one other pass at a time interrupts (a 1F1B
               alternation between two chunks keeps both), so an elastic group's passes
               through the chunk, or a breadth-first chunk's forwards, are one visit.
               Only the gathered (compute) parameters go: FSDP2 keeps the accumulated
               unsharded gradients across a reshard while gradient sync is off.

A policy list holds one policy for all chunks or one per chunk, in stage order:
`parse_sharding("zero3,replicate")`; `per_stage(policies, num_stages)` expands and checks
it against the schedule's stage count.
"""
from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

__all__ = ["FSDP_POLICIES", "ShardingPolicy", "parse_sharding", "per_stage"]


class ShardingPolicy(str, Enum):
    """What a chunk shards over the data-parallel replicas (ZeRO stages; FSDP2 in torch)."""

    REPLICATE = "replicate"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    ZERO3_REGATHER = "zero3-regather"

    def __str__(self) -> str:  # "zero3", not "ShardingPolicy.ZERO3"
        return self.value

    @property
    def shards_parameters(self) -> bool:
        """The Program gathers (UNSHARD) and frees (RESHARD) the chunk's parameters."""
        return self is ShardingPolicy.ZERO3 or self is ShardingPolicy.ZERO3_REGATHER

    @property
    def regathers(self) -> bool:
        """The chunk's parameters are freed between its visits and gathered again."""
        return self is ShardingPolicy.ZERO3_REGATHER

    @property
    def fsdp(self) -> bool:
        """FSDP2 holds the chunk (zero2, zero3, zero3-regather): sharded between steps."""
        return self in FSDP_POLICIES

    @property
    def storage(self) -> ShardingPolicy:
        """The policy whose state the chunk holds (zero3 for zero3-regather: they differ only
        in where the Program frees the gathered parameters)."""
        return ShardingPolicy.ZERO3 if self is ShardingPolicy.ZERO3_REGATHER else self


# the policies FSDP2 holds (`fully_shard`): sharded between steps
FSDP_POLICIES = frozenset({ShardingPolicy.ZERO2, ShardingPolicy.ZERO3, ShardingPolicy.ZERO3_REGATHER})
_NAMES = ", ".join(p.value for p in ShardingPolicy)


def parse_sharding(text: str | Iterable[str | ShardingPolicy]) -> tuple[ShardingPolicy, ...]:
    """'zero3' or 'zero3,replicate,...' (or a sequence of names) -> the policy tuple."""
    items = [x.strip() for x in text.split(",")] if isinstance(text, str) else [str(x).strip() for x in text]
    if not items or any(not x for x in items):
        raise ValueError(f"--sharding {text!r}: give a policy ({_NAMES}) or a comma-separated list, one per chunk")
    out = []
    for item in items:
        try:
            out.append(ShardingPolicy(item.lower()))
        except ValueError:
            raise ValueError(f"--sharding: unknown policy {item!r}; choose one of {_NAMES}") from None
    return tuple(out)


def per_stage(policies: Iterable[ShardingPolicy], num_stages: int) -> tuple[ShardingPolicy, ...]:
    """One policy per global stage: a single policy applies to every stage; otherwise the
    list must have exactly one policy per stage."""
    given = tuple(ShardingPolicy(p) for p in policies)
    if len(given) == 1:
        return given * num_stages
    if len(given) != num_stages:
        raise ValueError(
            f"--sharding gives {len(given)} policies but the schedule has {num_stages} chunks (global stages): "
            f"give one policy for all chunks or exactly {num_stages}, in stage order"
        )
    return given
