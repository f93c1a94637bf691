"""`train --verify` with recomputation on a p=2 x d=2 mesh (zero3): elastic with explicit
and automatic groups, each with --recompute none, all and auto, and 1f1b-r; every case is
the check `train --verify` makes (`train.run.judge`), run in one set of 4 processes."""
from __future__ import annotations

import pytest

from pipeblocks.resolve.request import Mesh, ScheduleRequest
from pipeblocks.core.ir.sharding import parse_sharding
from pipeblocks.models import GPTConfig
from pipeblocks.runtime import spawn
from pipeblocks.train.run import judge, prepare

from _recompute_cases import verify_worker

pytestmark = pytest.mark.spawn

MODEL = GPTConfig(layers=4, hidden=16, heads=2, seq=8, vocab=256, dtype="float64")
EXPLICIT = (("forward_groups", "2,2"), ("backward_groups", "4"))
# unit costs: full recomputation needs 14.6 per rank here, nothing 17; at 15 `auto` recomputes some pairs
GPU_MEMORY = 15.0
CASES = {
    f"elastic-{groups}-{mode}": ("elastic", options, mode)
    for groups, options in (("explicit", EXPLICIT), ("auto", ()))
    for mode in ("none", "all", "auto")
} | {"1f1b-r": ("1f1b-r", (), "none"), "elastic-float32": ("elastic", (), "none")}


def _config(case: str):
    name, options, mode = CASES[case]
    request = ScheduleRequest(name=name, m=4, mesh=Mesh(pp=2, dp=2), options=options,
                              sharding=parse_sharding("zero3"), recompute=mode,
                              gpu_memory=GPU_MEMORY if mode == "auto" else None)
    if case.endswith("float32"):  # the CLI's default model and microbatch
        return prepare(request, model=GPTConfig(vocab=256), verify=True, timeout_s=120.0)
    return prepare(request, model=MODEL, microbatch_size=1, verify=True, timeout_s=120.0)


@pytest.fixture(scope="module")
def runs():
    prepared = {case: _config(case) for case in CASES}
    per_rank = spawn(verify_worker, 4, args=([cfg for cfg, _ in prepared.values()],), timeout_s=240,
                     threads_per_rank=1)
    return {case: (cfg, data, [rank[i] for rank in per_rank]) for i, (case, (cfg, data)) in enumerate(prepared.items())}


@pytest.mark.parametrize("case", list(CASES))
def test_verify_passes(runs, case):
    cfg, data, results = runs[case]
    pairs = cfg.schedule.recompute
    mode = CASES[case][2]
    if mode == "none" and case != "1f1b-r":
        assert not pairs
    elif mode == "all" or case == "1f1b-r":
        assert len(pairs) == cfg.schedule.num_stages * cfg.schedule.m
    else:
        assert 0 < len(pairs) < cfg.schedule.num_stages * cfg.schedule.m, "auto recomputes some pairs, not all"
    largest, tolerance, lines = judge(cfg, data, results)
    assert largest <= tolerance, "\n".join(lines)
