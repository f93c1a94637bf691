"""Data-parallel sharding policies, one per chunk (global stage).

    replicate  every replica holds parameters, gradients and optimizer state; gradients
               are all-reduced once per step
    zero1      optimizer state sharded over the d replicas (gradients still all-reduced)
    zero2      and gradients reduce-scattered (each replica keeps its shard)
    zero3      and parameters sharded: gathered (UNSHARD) before a chunk's passes, freed
               (RESHARD) after them

A policy list holds one policy for all chunks or one per chunk, in stage order:
`parse_sharding("zero3,replicate")`; `per_stage(policies, num_stages)` expands and checks
it against the schedule's stage count.
"""
from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

__all__ = ["ShardingPolicy", "parse_sharding", "per_stage"]


class ShardingPolicy(str, Enum):
    """What a chunk shards over the data-parallel replicas (ZeRO stages; FSDP2 in torch)."""

    REPLICATE = "replicate"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"

    def __str__(self) -> str:  # "zero3", not "ShardingPolicy.ZERO3"
        return self.value

    @property
    def shards_parameters(self) -> bool:
        return self is ShardingPolicy.ZERO3


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
