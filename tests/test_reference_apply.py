"""`train --verify` checks the ranks' optimizer step against the step one process takes from
the ranks' own gradients (`reference_apply`), because AdamW's first step is ill conditioned
where a gradient is near zero: rounding-size gradient differences move such weights by
up to lr."""
from __future__ import annotations

import pytest
import torch

from pipeblocks.models import GPTConfig
from pipeblocks.train.reference import compare_grads, reference_apply, reference_update

pytestmark = pytest.mark.torch

CFG = GPTConfig(layers=2, hidden=16, heads=2, seq=8, vocab=32, dtype="float32")


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab, (4, CFG.seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def test_apply_repeats_the_reference_step_exactly():
    x, y = _batch()
    _, grads, params, _ = reference_update(CFG, seed=0, inputs=x, targets=y, microbatches=2, lr=3e-3, max_norm=None)
    stepped = reference_apply(CFG, seed=0, grads=grads, lr=3e-3)
    assert all(torch.equal(stepped[n], params[n]) for n in params)


def test_rounding_noise_on_gradients_moves_adamw_weights_far():
    """Why the weights are not compared with the reference's own step: gradients equal to
    float32 rounding (1e-7 of the largest) give weights 1e-5 apart after AdamW."""
    x, y = _batch()
    _, grads, params, _ = reference_update(CFG, seed=0, inputs=x, targets=y, microbatches=2, lr=3e-3, max_norm=None)
    g = torch.Generator().manual_seed(1)
    noisy = {n: t + 1e-7 * t.abs().max() * torch.randn(t.shape, generator=g) for n, t in grads.items()}
    assert compare_grads(noisy, grads).relative < 1e-6
    assert compare_grads(reference_apply(CFG, seed=0, grads=noisy, lr=3e-3), params).relative > 1e-5


def test_apply_needs_every_gradient():
    x, y = _batch()
    _, grads, _, _ = reference_update(CFG, seed=0, inputs=x, targets=y, microbatches=2, lr=3e-3, max_norm=None)
    grads.pop(next(iter(grads)))
    with pytest.raises(ValueError, match="no gradient for parameter"):
        reference_apply(CFG, seed=0, grads=grads, lr=3e-3)
