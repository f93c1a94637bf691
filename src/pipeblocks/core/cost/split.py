"""How many transformer layers each pipeline stage holds: one rule for the analytic cost
model and for the model splitter, so that what is predicted is what runs.

Only transformer layers count. The embedding rides on stage 0 and the final norm and LM
head on stage S-1. Layers are spread as evenly as possible; when they do not divide
evenly, the extra layers go first to the middle stages 1..S-2, then to stage 0, then to
stage S-1, so the two ends, which carry the embedding and the head, get the lighter share:

    layers=10, S=4  ->  2 3 3 2        layers=5, S=2  ->  3 2        layers=7, S=4  ->  2 2 2 1

Every stage needs at least one layer, so layers < S is an error that names both numbers.

A run may instead give the counts itself (`--split 3,4,4,3`: one per global stage, in
stage order, so p*v of them for a looped or V schedule) or ask the simulator to choose them
(`--split auto`, `resolve.split_auto`). `parse_split` reads the option, `check_split` checks
counts against the model and the pipeline, and `stage_layers` is the one answer every
consumer asks: the given counts, or the rule above.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["AUTO", "layer_counts", "rank_balanced", "parse_split", "check_split", "stage_layers", "split_text"]

AUTO = "auto"
"""`--split auto`: the simulator chooses the counts (`resolve.split_auto`)."""


def layer_counts(layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage, balanced as the module docstring describes."""
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {num_stages}")
    if layers < num_stages:
        raise ValueError(
            f"the model has {layers} transformer layers but the pipeline has {num_stages} stages, and every "
            f"stage needs at least one layer: use {num_stages} or more layers (--layers {num_stages}) "
            "or fewer stages (lower -p or -v)"
        )
    base, extra = divmod(layers, num_stages)
    priority = list(range(1, num_stages - 1)) + [0, num_stages - 1][: min(2, num_stages)]
    counts = [base] * num_stages
    for stage in priority[:extra]:
        counts[stage] += 1
    return tuple(counts)


def rank_balanced(layers: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage, the first `layers mod num_stages` stages one more: with equal layers
    and no vocabulary layer on any stage (vocabulary parallelism), every rank then holds within
    one layer of every other under a loop placement with any number of chunks (rank r: stages
    r, r + p, ...) and under a V placement (rank r: stages r and 2p - 1 - r), where the even rule's
    lighter end stages would leave rank 0 two layers short of the middle ranks.

        >>> rank_balanced(28, 8)
        (4, 4, 4, 4, 3, 3, 3, 3)
    """
    base, extra = divmod(layers, num_stages)
    return tuple(base + (1 if stage < extra else 0) for stage in range(num_stages))


def split_text(counts: Sequence[int]) -> str:
    """The counts as `--split` takes them: (3, 4, 4, 3) -> '3,4,4,3'."""
    return ",".join(str(n) for n in counts)


def parse_split(text: str | None) -> tuple[int, ...] | str | None:
    """`--split`: None (the even rule), 'auto', or comma-separated layer counts per stage.

    >>> parse_split("3,4,4,3"), parse_split("auto"), parse_split(None)
    ((3, 4, 4, 3), 'auto', None)
    """
    if text is None:
        return None
    stripped = text.strip()
    if stripped.lower() == AUTO:
        return AUTO
    items = [item.strip() for item in stripped.split(",")]
    try:
        counts = tuple(int(item) for item in items)
    except ValueError:
        raise ValueError(
            f"--split {text!r}: give the transformer layers of every stage as integers in stage order "
            "(e.g. --split 3,4,4,3) or --split auto"
        ) from None
    bad = [n for n in counts if n < 1]
    if bad:
        stage = counts.index(bad[0])
        raise ValueError(
            f"--split {text!r} gives stage {stage} {bad[0]} layers, and every stage needs at least one layer: "
            "move a layer to it from a neighbour"
        )
    return counts


def check_split(counts: Sequence[int], *, layers: int, num_stages: int, p: int | None = None) -> tuple[int, ...]:
    """`counts` as given by `--split`, checked against a model of `layers` transformer layers
    cut into `num_stages` global stages (p ranks times v chunks each): one count per stage,
    each at least 1, summing to `layers`. The errors name the numbers and the fix."""
    counts = tuple(counts)
    given = split_text(counts)
    if len(counts) != num_stages:
        why = ""
        if p is not None and p > 0 and num_stages % p == 0:
            v = num_stages // p
            why = f" (p={p} ranks x v={v} chunks per rank)" if v > 1 else f" (p={p} ranks, one stage each)"
        raise ValueError(
            f"--split {given} gives {len(counts)} counts but the pipeline has {num_stages} stages{why}: "
            f"give {num_stages} layer counts, one per stage in stage order"
        )
    if min(counts) < 1:
        stage = counts.index(min(counts))
        raise ValueError(
            f"--split {given} gives stage {stage} {counts[stage]} layers, and every stage needs at least one layer: "
            "move a layer to it from a neighbour"
        )
    if sum(counts) != layers:
        raise ValueError(
            f"--split {given} sums to {sum(counts)} layers but the model has {layers}: give counts that sum "
            f"to {layers}" + (f" (the even split is {split_text(layer_counts(layers, num_stages))})"
                              if layers >= num_stages else "")
        )
    return counts


def stage_layers(layers: int, num_stages: int, split: Sequence[int] | None = None, *,
                 p: int | None = None) -> tuple[int, ...]:
    """Layers per stage: `split` when given (checked by `check_split`), else `layer_counts`."""
    if split is None:
        return layer_counts(layers, num_stages)
    return check_split(split, layers=layers, num_stages=num_stages, p=p)
