"""How many transformer layers each pipeline stage holds: one rule for the analytic cost
model and for the model splitter, so that what is predicted is what runs.

Only transformer layers count. The embedding rides on stage 0 and the final norm and LM
head on stage S-1. Layers are spread as evenly as possible; when they do not divide
evenly, the extra layers go first to the middle stages 1..S-2, then to stage 0, then to
stage S-1, so the two ends, which carry the embedding and the head, get the lighter share:

    layers=10, S=4  ->  2 3 3 2        layers=5, S=2  ->  3 2        layers=7, S=4  ->  2 2 2 1

Every stage needs at least one layer, so layers < S is an error that names both numbers.
"""
from __future__ import annotations

__all__ = ["layer_counts"]


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
