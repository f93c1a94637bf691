"""Invariant 2: every registered schedule, run by the runtime on gloo, gives the loss and the
gradients of one process training the whole model (float64, relative 1e-10).

One spawn per pipeline size runs every schedule (two steps each, the second compared), so
new registrations are covered without new processes.
"""
from __future__ import annotations

import pytest

from pipeblocks import schedules
from pipeblocks.runtime import spawn

from _runtime_cases import EXTRA, exact_worker, reference, try_build

pytestmark = pytest.mark.spawn

SIZES = [(2, 4), (3, 5), (4, 4)]  # (p, m): m below, at and not a multiple of p
CASES = schedules.names() + EXTRA
RTOL = 1e-10


@pytest.fixture(scope="module")
def runs():
    """p -> results from one spawn running every case that builds for that p (or the error)."""
    results = {}
    for p, m in SIZES:
        runnable = [(case, m) for case in CASES if try_build(case, p, m) is None]
        try:
            results[p] = spawn(exact_worker, p, args=(runnable,), timeout_s=150, threads_per_rank=1)
        except Exception as err:  # noqa: BLE001 - reported by every test of this p
            results[p] = err
    return results


@pytest.mark.parametrize("p,m", SIZES, ids=[f"p{p}m{m}" for p, m in SIZES])
@pytest.mark.parametrize("case", CASES)
def test_matches_single_process(runs, case, p, m):
    reason = try_build(case, p, m)
    if reason is not None:
        pytest.skip(f"{case}: {reason}")
    per_rank = runs[p]
    if isinstance(per_rank, Exception):
        raise per_rank
    ref_loss, ref_grads = reference(case, p, m)
    seen_stages = set()
    losses = [r[case]["loss"] for r in per_rank if r[case]["loss"] is not None]
    assert len(losses) == 1, "exactly one rank holds the last stage and reports the loss"
    assert losses[0] == pytest.approx(ref_loss, rel=RTOL, abs=0)
    for rank_result in per_rank:
        for stage, grads in rank_result[case]["grads"].items():
            seen_stages.add(stage)
            for got, want in zip(grads, ref_grads[stage], strict=True):
                scale = want.abs().max().item()
                assert scale > 0
                err = (got - want).abs().max().item() / scale
                assert err <= RTOL, f"stage {stage}: relative gradient error {err:.3g}"
    assert seen_stages == set(ref_grads), "every stage's gradients came back"
