"""Where a model's parts sit, by module path, and which blocks each pipeline stage holds.

    >>> Layout(blocks="model.layers", before=("model.embed_tokens",), after=("model.norm", "lm_head"),
    ...        shared=("model.rotary_emb",))
    >>> block_ranges(10, 4)
    (range(0, 2), range(2, 5), range(5, 8), range(8, 10))

A layout names, by dotted path from the model's root, the one `nn.ModuleList` of repeated
blocks, the modules that run before them (on stage 0, in order) and after them (on the
last stage, in order), and "shared" modules that every stage holds: parameter-free helpers
such as a rotary-embedding table, which each stage recomputes rather than receives.

Stage s holds the s-th contiguous slice of blocks, whatever the placement; counts come
from `pipeblocks.core.cost.split.layer_counts` (the end stages, which carry the embedding and
the head, get the lighter share) or are given explicitly.

Torch-free: the command line and the family registry read it without importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..core.cost.split import layer_counts

__all__ = ["Layout", "block_ranges", "layer_ranges"]


@dataclass(frozen=True)
class Layout:
    """A model's structure as the splitter sees it; every entry is a dotted module path."""

    blocks: str
    """The `nn.ModuleList` of repeated blocks, e.g. "layers" or "model.layers"."""
    before: tuple[str, ...] = ()
    """Modules run on stage 0 before the first block, in this order (embeddings)."""
    after: tuple[str, ...] = ()
    """Modules run on the last stage after the last block, in this order (final norm, head)."""
    shared: tuple[str, ...] = ()
    """Parameter-free modules every stage holds and uses (a rotary table); built per stage."""

    def __post_init__(self) -> None:
        for field_name in ("before", "after", "shared"):
            value = getattr(self, field_name)
            if isinstance(value, str):  # a bare string would be split into letters
                raise TypeError(f"Layout.{field_name} must be a tuple of paths, got the string {value!r}: "
                                f"write {field_name}=({value!r},)")
            object.__setattr__(self, field_name, tuple(value))
        paths = self.paths()
        for path in paths:
            if not isinstance(path, str) or not path or any(not atom for atom in path.split(".")):
                raise ValueError(f"bad module path {path!r} in the layout: give a dotted path such as 'model.layers'")
        for a in paths:
            for b in paths:
                if a is not b and (a == b or b.startswith(a + ".")):
                    raise ValueError(f"layout paths overlap: {a!r} and {b!r}; name each module once, and no module "
                                     "inside another one named")

    def paths(self) -> tuple[str, ...]:
        """Every path named, blocks first."""
        return (self.blocks, *self.before, *self.after, *self.shared)


def layer_ranges(counts: Sequence[int]) -> tuple[range, ...]:
    """Block index ranges from per-stage counts: (2, 3) -> (range(0, 2), range(2, 5))."""
    ranges, start = [], 0
    for n in counts:
        ranges.append(range(start, start + n))
        start += n
    return tuple(ranges)


def block_ranges(num_blocks: int, num_stages: int, counts: Sequence[int] | None = None,
                 *, blocks: str = "blocks") -> tuple[range, ...]:
    """Global block indices of every stage: balanced by `layer_counts`, or from explicit counts.

    `blocks` names the block list in error messages.
    """
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got num_stages={num_stages}")
    if num_blocks < num_stages:
        raise ValueError(
            f"{blocks!r} holds {num_blocks} blocks but the pipeline has {num_stages} stages, and every stage needs "
            f"at least one block: use {num_blocks} stages or fewer, or a model with {num_stages} blocks or more"
        )
    if counts is None:
        return layer_ranges(layer_counts(num_blocks, num_stages))
    counts = tuple(counts)
    if len(counts) != num_stages or sum(counts) != num_blocks or min(counts) < 1:
        raise ValueError(
            f"layer counts {list(counts)} do not fit {num_stages} stages of {num_blocks} blocks: "
            f"give {num_stages} counts, each >= 1, summing to {num_blocks}"
        )
    return layer_ranges(counts)
