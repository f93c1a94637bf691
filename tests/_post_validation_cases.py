"""Shared by test_post_validation: a rank worker (spawned, so it lives at module level) and
the gradients it is fed, chosen to reach every branch of the post-validated step."""
from __future__ import annotations

import torch

from pipeblocks.train.post_validation import PostValidator

MAX_NORM = 1.0
LR = 0.1
# Per step, the gradient scale of rank 0 and rank 1 (|linspace(-1, 1, 5)| = 1.58):
#   0: both local norms and the global norm below 1           -> optimistic steps stand
#   1: both local norms below 1, the global norm above        -> both ranks undo and redo clipped
#   2: rank 1's own norm already above 1                      -> rank 1 waits, rank 0 undoes
#   3: rank 1's gradient is infinite                          -> skipped everywhere, rank 0 undoes
#   4: as step 0, from optimizer state that survived the undos
SCALES = ((0.3, 0.3), (0.5, 0.5), (0.2, 0.9), (0.3, 0.3), (0.3, 0.3))
NONFINITE = {3: 1}  # step -> rank with an infinite gradient


def gradient(step: int, rank: int) -> torch.Tensor:
    g = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64) * SCALES[step][rank] * (1 + 0.1 * rank)
    if NONFINITE.get(step) == rank:
        g[2] = float("inf")
    return g


def initial(rank: int) -> torch.Tensor:
    return torch.arange(5, dtype=torch.float64) * 0.1 + rank


def validator_worker(ctx) -> dict[bool, list[tuple[str, bool, bool, float, torch.Tensor]]]:
    """optimistic (True) and barrier (False) runs, one after the other: for each step on this rank,
    (outcome, optimistic, rolled_back, coefficient, weights after)."""
    return {mode: _run(ctx, mode) for mode in (True, False)}


def _run(ctx, optimistic: bool) -> list[tuple[str, bool, bool, float, torch.Tensor]]:
    weight = torch.nn.Parameter(initial(ctx.rank))
    validator = PostValidator(torch.optim.AdamW([weight], lr=LR), max_norm=MAX_NORM, optimistic=optimistic,
                              timeout_s=60)
    records = []
    for step in range(len(SCALES)):
        weight.grad = gradient(step, ctx.rank)
        check = validator.step()
        records.append((check.outcome, check.optimistic, check.rolled_back, check.coefficient,
                        weight.detach().clone()))
    return records
