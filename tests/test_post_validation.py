"""Optimizer post-validation: global-norm clipping and non-finite skips with an optimistic step.

Exactness is against synchronous clipping: the same validator with a barrier (bit for bit),
and one process clipping with torch.nn.utils.clip_grad_norm_ (to rounding).
"""
from __future__ import annotations

import json
import re

import pytest
import torch
from _post_validation_cases import (
    LR,
    MAX_NORM,
    NONFINITE,
    SCALES,
    gradient,
    initial,
    validator_worker,
)

from pipeblocks.runtime import spawn
from pipeblocks.train.post_validation import PostValidator, clip_coefficient
from test_train import SMALL, _train

pytestmark = pytest.mark.spawn


def _one_process() -> list[list[torch.Tensor]]:
    """Synchronous clipping over both ranks' weights in one process; weights after each step."""
    weights = [torch.nn.Parameter(initial(r)) for r in (0, 1)]
    optimizer = torch.optim.AdamW(weights, lr=LR)
    after = []
    for step in range(len(SCALES)):
        for r, w in enumerate(weights):
            w.grad = gradient(step, r)
        norm = torch.nn.utils.clip_grad_norm_(weights, MAX_NORM)
        if torch.isfinite(norm):
            optimizer.step()
        after.append([w.detach().clone() for w in weights])
    return after


@pytest.fixture(scope="module")
def runs():
    by_rank = spawn(validator_worker, 2, timeout_s=120, threads_per_rank=1)
    return {mode: [ranks[mode] for ranks in by_rank] for mode in (True, False)}


def test_every_branch_is_reached_on_the_right_ranks(runs):
    optimistic = runs[True]
    outcomes = [[(o, opt, back) for o, opt, back, _, _ in records] for records in optimistic]
    assert outcomes[0] == [("stepped", True, False), ("clipped", True, True), ("clipped", True, True),
                           ("skipped", True, True), ("stepped", True, False)]
    assert outcomes[1] == [("stepped", True, False), ("clipped", True, True), ("clipped", False, False),
                           ("skipped", False, False), ("stepped", True, False)]
    # both ranks saw the same global decision and coefficient
    for step in range(len(SCALES)):
        assert optimistic[0][step][0] == optimistic[1][step][0]
        assert optimistic[0][step][3] == optimistic[1][step][3]
    assert 0 < optimistic[0][1][3] < 1 and optimistic[0][3][3] == 0.0


def test_optimistic_equals_the_barrier_bit_for_bit_and_one_process_to_rounding(runs):
    reference = _one_process()
    for rank in (0, 1):
        for step in range(len(SCALES)):
            optimistic, barrier = runs[True][rank][step], runs[False][rank][step]
            assert optimistic[0] == barrier[0] and optimistic[3] == barrier[3]
            assert torch.equal(optimistic[4], barrier[4]), (rank, step)
            torch.testing.assert_close(optimistic[4], reference[step][rank], rtol=1e-12, atol=1e-14)
    # the skipped step changed nothing, on either rank
    skipped = next(iter(NONFINITE))
    for rank in (0, 1):
        assert torch.equal(runs[True][rank][skipped][4], runs[True][rank][skipped - 1][4])


def test_clip_coefficient_and_bad_max_norm():
    assert clip_coefficient(0.5, 1.0) == 1.0 and clip_coefficient(3.0, None) == 1.0
    assert clip_coefficient(2.0, 1.0) == pytest.approx(0.5, rel=1e-6)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
            PostValidator(opt, max_norm=bad)


# ---- through `pipeblocks train` ---------------------------------------------------------


def test_verify_with_clipping_matches_synchronous_clipping_after_an_undone_step():
    # the global norm of this step is 1.79 and each rank's own part is below 1.6: both ranks
    # step optimistically, then undo and redo the step clipped
    proc = _train("--schedule", "zb-h1", *SMALL, "--layers", "4", "--dtype", "float64", "--verify",
                  "--clip-grad", "1.6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"clipped, 2 rank\(s\) undid an optimistic step", proc.stdout), proc.stdout
    match = re.search(r"largest relative difference ([\d.e+-]+), tolerance ([\d.e+-]+): OK", proc.stdout)
    assert match and float(match.group(1)) <= 1e-10


def test_injected_inf_skips_exactly_that_step_on_every_rank(tmp_path):
    from pipeblocks.data import TokenWindows
    from pipeblocks.models import GPTConfig
    from pipeblocks.train.reference import reference_losses

    # the reference below trains at a constant rate on the whole corpus
    proc = _train("--schedule", "1f1b", *SMALL, "--dtype", "float64", "--steps", "4", "--clip-grad", "0.5",
                  "--lr-schedule", "constant", "--warmup-steps", "0", "--held-out", "0",
                  "--inject-nonfinite", "2", "--report", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^step +2/4 .*skipped \(non-finite gradient\)", proc.stdout, re.MULTILINE)
    assert "skipped steps [2] (non-finite gradient) on every rank" in proc.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["skipped_steps"] == [[2], [2]]
    # a one-process run that clips synchronously and makes no update for step 2's batch
    model = GPTConfig(layers=2, hidden=16, heads=2, seq=16, vocab=256, dtype="float64")
    data = TokenWindows.load(None, seq=16)
    batches = [data.batch(step, 4, seed=0) for step in range(4)]
    expected = reference_losses(model, seed=0, batches=batches, microbatches=2, lr=3e-3, max_norm=0.5, skip={1})
    without_skip = reference_losses(model, seed=0, batches=batches, microbatches=2, lr=3e-3, max_norm=0.5)
    assert [row["step"] for row in report["losses"]] == [1, 2, 3, 4]
    got = [row["loss"] for row in report["losses"]]
    for a, b in zip(got, expected):
        assert abs(a - b) <= 1e-10 * abs(b), (got, expected)
    assert abs(got[2] - without_skip[2]) > 1e-6  # the skip changed what followed


# ---- tentative steps: kept equals torch's step bit for bit, dropped leaves no trace --------
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, foreach=False),
    lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1, betas=(0.8, 0.9), foreach=False),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
], ids=["adamw", "adam-coupled-decay", "sgd-copy-rollback"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_kept_tentative_step_is_torchs_step_and_a_dropped_one_leaves_no_trace(make, dtype):
    from pipeblocks.train.tentative import AdamOutOfPlace, CopyRollback, tentative_step

    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    mine_opt, torch_opt = make(ours), make(theirs)
    step = tentative_step(mine_opt)
    assert isinstance(step, AdamOutOfPlace if isinstance(mine_opt, torch.optim.Adam) else CopyRollback)
    for k in range(6):
        grads = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        step.take()
        if k in (0, 3):  # dropped: the first (no state yet) and a later one
            step.drop()
        else:
            step.keep()
            torch_opt.step()
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q), (k, (p - q).abs().max())
            for key, value in torch_opt.state.get(q, {}).items():
                assert torch.equal(mine_opt.state[p][key], value), (k, key)
        assert (ours[0] in mine_opt.state) == (theirs[0] in torch_opt.state)


def test_dry_run_counts_the_spare_copies_unless_the_step_waits_at_a_barrier(monkeypatch, capsys):
    from pipeblocks.cli.main import main
    from pipeblocks.train import run

    printed: list[dict] = []
    real_dry_run = run.dry_run
    monkeypatch.setattr(run, "dry_run", lambda *a, **k: printed.append(real_dry_run(*a, **k)))
    args = ["train", "--dry-run", "--schedule", "1f1b", "-p", "2", "-m", "2", "--layers", "2", "--hidden", "16",
            "--heads", "2", "--seq", "8", "--emulate", "1,1,1"]
    assert main(args) == 0 and main([*args, "--step-barrier"]) == 0
    optimistic, barrier = ([r["static_bytes_predicted"] for r in f["ranks"]] for f in printed)
    assert all(o * 16 == b * 28 for o, b in zip(optimistic, barrier))
