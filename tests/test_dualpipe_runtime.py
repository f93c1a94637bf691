"""DualPipeV on the runtime: the overlap hook of the stage class runs every pair, exactly;
`pipeblocks train --verify` in float64 with --dp 2 --sharding zero3 (the plain path, F then
B, is in test_runtime_exact with every registered schedule, at p=2)."""
from __future__ import annotations

import re

import pytest

from pipeblocks.core.lowering import lower_for
from pipeblocks.core.program import Overlap
from pipeblocks.runtime import spawn
from pipeblocks.schedules import get

from _dualpipe_cases import hooked_worker
from _runtime_cases import reference
from test_train import _train

pytestmark = pytest.mark.spawn


def test_overlap_hook_runs_every_pair_and_matches_one_process():
    p, m = 4, 8
    per_rank = spawn(hooked_worker, p, args=(m,), timeout_s=90, threads_per_rank=1)
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
