"""Checkpoints, the single-process reference, and `pipeblocks train` end to end."""
from __future__ import annotations

import pytest
import torch

from pipeblocks.models import GPT, GPTConfig, build_stages, cross_entropy
from pipeblocks.train.checkpoint import check_meta, latest_step, load_rank, restore_rank, save_rank
from pipeblocks.train.reference import compare_grads, reference_step

TINY = GPTConfig(layers=2, hidden=16, heads=2, seq=8, vocab=32, dtype="float64")


def _train_steps(stages, opt, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, TINY.vocab, (2, TINY.seq), generator=g)
        opt.zero_grad()
        out = x
        for st in stages.values():
            out = st(out)
        loss = cross_entropy(out, torch.roll(x, -1, dims=1)) + 1e-3 * torch.rand(())  # draws from the global RNG
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _fresh():
    stages = {s.index: s for s in build_stages(TINY, seed=0, num_stages=2, stages=(0, 1))}
    return stages, torch.optim.AdamW([p for s in stages.values() for p in s.parameters()], lr=1e-2)


def test_checkpoint_resume_continues_exactly(tmp_path):
    torch.manual_seed(0)
    stages, opt = _fresh()
    straight = _train_steps(stages, opt, 5)

    torch.manual_seed(0)
    stages, opt = _fresh()
    first = _train_steps(stages, opt, 3)
    save_rank(tmp_path, rank=0, step=3, stages=stages, optimizer=opt, meta={"run": "a"})
    _train_steps(stages, opt, 4, start=3)  # diverge after the save: resume must undo this

    stages, opt = _fresh()
    step = latest_step(tmp_path, world_size=1)
    assert step == 3
    assert restore_rank(load_rank(tmp_path, rank=0, step=step), stages, opt) == 3
    assert first + _train_steps(stages, opt, 2, start=3) == straight


def test_latest_step_is_the_newest_every_rank_has_and_old_files_are_pruned(tmp_path):
    stages, opt = _fresh()
    for step in (1, 2, 3):
        save_rank(tmp_path, rank=0, step=step, stages=stages, optimizer=opt, meta={})
    save_rank(tmp_path, rank=1, step=2, stages=stages, optimizer=opt, meta={})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["rank0-step00000002.pt", "rank0-step00000003.pt", "rank1-step00000002.pt"]
    assert latest_step(tmp_path, world_size=2) == 2
    assert latest_step(tmp_path, world_size=3) is None
    assert latest_step(tmp_path / "nothing", world_size=1) is None


def test_checkpoint_of_another_run_is_refused(tmp_path):
    with pytest.raises(ValueError, match="p: checkpoint 2, now 4.*new --checkpoint directory"):
        check_meta({"p": 2, "schedule": "1f1b"}, {"p": 4, "schedule": "1f1b"}, tmp_path)
    stages, opt = _fresh()
    save_rank(tmp_path, rank=0, step=1, stages={0: stages[0]}, optimizer=opt, meta={})
    with pytest.raises(ValueError, match=r"holds stages \[0\].*gives it \[0, 1\]"):
        restore_rank(load_rank(tmp_path, rank=0, step=1), stages, opt)


def test_reference_step_matches_a_whole_batch_step_and_compare_finds_the_worst():
    x = torch.randint(0, TINY.vocab, (4, TINY.seq), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, dims=1)
    loss, grads = reference_step(TINY, seed=0, inputs=x, targets=y, microbatches=2)
    model = GPT(TINY, seed=0)
    whole = cross_entropy(model(x), y)
    whole.backward()
    assert abs(loss - whole.item()) < 1e-12
    expected = {n: p.grad for n, p in model.named_parameters()}
    assert compare_grads(grads, expected).relative < 1e-12
    bumped = dict(grads, **{"head.out.weight": grads["head.out.weight"] * (1 + 1e-6)})
    worst = compare_grads(bumped, expected)
    assert worst.name == "head.out.weight" and 0.5e-6 < worst.relative < 2e-6
