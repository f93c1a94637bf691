"""Data-parallel units: which blocks of a chunk are gathered and reduced together.

A chunk's parameters form one or more units of consecutive blocks. Each unit is one
FSDP2 parameter group (`fully_shard` per unit, as torchtitan wraps every transformer
block) or one gradient bucket (replicate, zero1), so its collectives pipeline with the
pass: the next unit's gather runs while this one computes, and a unit's reduction starts
as soon as its own gradients are complete. The embedding joins the first block's unit and
the head (with the final norm) the last block's.

    chunk   one unit per chunk: the whole chunk is gathered and reduced at once
    block   one unit per block

    >>> units = units_for("block", blocks=(2, 2, 2, 2))
    >>> units.count(1), units.sizes[1]
    (2, (1, 1))
    >>> units_for("chunk", blocks=(2, 2, 2, 2)) is None     # chunk grain: the ops carry no unit
    True

In the Program a DP op of a stage with several units names its unit after a dot
(`2UNSHARD.1`, `2REDUCE_GRAD.0`); a stage of one unit keeps torch's per-stage form
(`2UNSHARD`), so chunk grain and a one-block stage read as before.

`prefetch` is how many of a zero3 chunk's units are gathered ahead of its first pass,
where the chunk's own gather is prefetched (`passes_dp`: a stage ahead). None, the
default, gathers all of them there, back to back, so the pass waits for its first unit
only; k gathers the first k there and each later unit u inside the pass, when it reaches
unit u - k. k = 1 is FSDP2's own per-block prefetch (the next block's gather while this one
computes), which a pipeline pays for: on a link where a block's gather outlasts its
forward, every chunk's first pass waits for its units one by one.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DP_UNIT_GRAINS", "DPUnits", "check_dp_unit", "check_prefetch", "units_for"]

DP_UNIT_GRAINS = ("chunk", "block")


def check_dp_unit(grain: object) -> str:
    """`grain` if it is one of DP_UNIT_GRAINS; a ValueError naming the choices otherwise."""
    if grain not in DP_UNIT_GRAINS:
        raise ValueError(
            f"--dp-unit {grain!r}: choose chunk (one unit per chunk: gathered and reduced at once) or block "
            "(one unit per block, as FSDP2 per block and DDP buckets communicate)"
        )
    return grain  # type: ignore[return-value]


def check_prefetch(prefetch: object) -> int | None:
    """`prefetch` if it is None (every unit ahead) or an integer >= 1; a ValueError otherwise."""
    if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1):
        raise ValueError(f"prefetch must be an integer >= 1 (units of a chunk gathered ahead of its first pass) or "
                         f"None (all of them), got {prefetch!r}")
    return prefetch


def _whole(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value) == int(value)


@dataclass(frozen=True)
class DPUnits:
    """Per global stage, the blocks of each unit in block order (`sizes[s]`; a stage with no
    block is one unit of 0 blocks, its end parts), and how many of a chunk's units are
    gathered ahead of its first pass (None: all)."""

    sizes: tuple[tuple[int, ...], ...]
    prefetch: int | None = None

    def __post_init__(self) -> None:
        check_prefetch(self.prefetch)
        sizes = tuple(tuple(units) for units in self.sizes)
        for stage, units in enumerate(sizes):
            if not units:
                raise ValueError(f"stage {stage} has no unit: give at least one (its blocks, or 0 for a stage of none)")
            if any(not _whole(n) or n < 0 for n in units) or (0 in units and units != (0,)):
                raise ValueError(f"units of stage {stage} {units}: each unit holds a whole number >= 1 of blocks")
        object.__setattr__(self, "sizes", tuple(tuple(int(n) for n in units) for units in sizes))

    @classmethod
    def from_sizes(cls, sizes: Sequence[Sequence[float]], blocks: Sequence[int], *,
                   prefetch: int | None = None) -> DPUnits:
        """Checked against the blocks per stage: one list per stage, each unit a whole number
        of consecutive blocks, together exactly the stage's blocks."""
        if len(sizes) != len(blocks):
            raise ValueError(f"the unit list has {len(sizes)} stages but the schedule has {len(blocks)}: "
                             "give one list of unit sizes per stage")
        for stage, (units, n) in enumerate(zip(sizes, blocks)):
            start = 0.0
            for k, size in enumerate(units):
                if isinstance(size, bool) or not isinstance(size, numbers.Real) or size < 0 or (size == 0 and n > 0):
                    raise ValueError(f"unit {k} of stage {stage} holds {size!r} blocks: give a whole number >= 1")
                if not _whole(size):
                    block = int(start + size)
                    raise ValueError(
                        f"unit {k} of stage {stage} holds {size:g} blocks: it would end inside block {block} of the "
                        f"stage (blocks 0..{n - 1}), splitting it; a unit holds whole blocks (give {int(size) or 1} "
                        f"or {int(size) + 1})"
                    )
                start += size
            if int(start) != n:
                raise ValueError(f"the units of stage {stage} hold {int(start)} blocks but the stage has {n}: "
                                 "together they must hold each of its blocks once")
        return cls(tuple(tuple(int(s) for s in units) for units in sizes), prefetch)

    @classmethod
    def per_block(cls, blocks: Sequence[int], *, prefetch: int | None = None) -> DPUnits:
        """One unit per block (a stage with no block: one unit of its end parts)."""
        return cls(tuple((1,) * n if n > 0 else (0,) for n in blocks), prefetch)

    @property
    def num_stages(self) -> int:
        return len(self.sizes)

    def count(self, stage: int) -> int:
        """How many units stage `stage` has."""
        return len(self.sizes[stage])

    def blocks_of(self, stage: int, unit: int) -> range:
        """The block indices (within the stage) of `unit`."""
        units = self.sizes[stage]
        start = sum(units[:unit])
        return range(start, start + units[unit])

    def check_stages(self, num_stages: int) -> None:
        if len(self.sizes) != num_stages:
            raise ValueError(f"DP units are given for {len(self.sizes)} stages but the schedule has {num_stages}: "
                             "give one unit list per stage (DPUnits.per_block(blocks per stage))")


def units_for(grain: str, blocks: Sequence[int], *, prefetch: int | None = None) -> DPUnits | None:
    """The units of `grain` for stages of `blocks` blocks each: None for chunk grain (one
    unit per chunk, the ops name no unit), one unit per block for block grain."""
    if check_dp_unit(grain) == "chunk":
        return None
    return DPUnits.per_block(blocks, prefetch=prefetch)
