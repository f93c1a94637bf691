"""DualPipe and DualPipeV on the runtime: the overlap hook of the stage class runs every pair,
exactly; DualPipe's two copies of every stage sum their gradients and stay equal;
`pipeblocks train --verify` in float64 with --dp 2 --sharding zero3 (the plain path, F then
B, is in test_runtime_exact with every registered schedule, at p=2)."""
from __future__ import annotations

import re

import pytest

from pipeblocks.core.lowering.entry import lower_for
from pipeblocks.core.ir.ops import Overlap
from pipeblocks.runtime import spawn
from pipeblocks.schedules import get

from _dualpipe_cases import both_worker, copies_reference
from _runtime_cases import reference
from test_train import _train

pytestmark = pytest.mark.spawn


P, M, STEPS = 4, 8, 2


@pytest.fixture(scope="module")
def runs():
    """One spawn of p=4 ranks: dualpipev through the overlap hook, dualpipe with its copies."""
    return spawn(both_worker, P, args=(M, STEPS), timeout_s=120, threads_per_rank=1)


def test_overlap_hook_runs_every_pair_and_matches_one_process(runs):
    p, m = P, M
    per_rank = [r["hooked"] for r in runs]
    program = lower_for(get("dualpipev")(p=p, m=m))
    for rank, result in enumerate(per_rank):
        assert result["calls"] == sum(type(op) is Overlap for op in program.ranks[rank]) > 0
    ref_loss, ref_grads = reference("dualpipev", p, m)
    assert [r["loss"] for r in per_rank if r["loss"] is not None] == [pytest.approx(ref_loss, rel=1e-12)]
    seen = set()
    for result in per_rank:
        for stage, grads in result["grads"].items():
            seen.add(stage)
            for got, want in zip(grads, ref_grads[stage], strict=True):
                assert (got - want).abs().max().item() <= 1e-12 * want.abs().max().item()
    assert seen == set(ref_grads)


def test_train_verify_is_exact_in_float64_under_dp2_zero3():
    proc = _train("--schedule", "dualpipev", "-p", "2", "-m", "4", "--layers", "4", "--dp", "2", "--sharding", "zero3",
                  "--hidden", "16", "--heads", "2", "--seq", "16",
                  "--microbatch-size", "2", "--timeout", "90", "--dtype", "float64", "--verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"largest relative difference ([\d.e+-]+), tolerance ([\d.e+-]+): OK", proc.stdout)
    assert match and float(match.group(1)) <= 1e-10, proc.stdout


def test_dualpipe_copies_stay_equal_and_match_one_process(runs):
    p, m, steps = P, M, STEPS
    per_rank = [r["copies"] for r in runs]
    losses, grads, weights = copies_reference(p, m, steps)
    # the two loss ranks (one per direction) each report their own microbatches' share
    for step in range(steps):
        shares = [r["losses"][step] for r in per_rank if r["losses"][step] is not None]
        assert len(shares) == 2 and sum(shares) == pytest.approx(losses[step], rel=1e-12)
    copies = 0
    for result in per_rank:
        for stage, got in result["grads"].items():
            model = stage % p
            copies += 1
            for g, w, want, want_w in zip(got, result["weights"][stage], grads[model], weights[model], strict=True):
                assert (g - want).abs().max().item() <= 1e-12 * want.abs().max().item()
                assert (w - want_w).abs().max().item() <= 1e-12 * want_w.abs().max().item()
    assert copies == 2 * p  # every model stage seen twice
