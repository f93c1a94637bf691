"""DP units in the runtime: `train --verify` (float64) at both grains, for 1f1b, zb-v,
elastic and bfs under replicate, zero1 and zero3 on a p=2 x d=2 mesh, in one set of four
processes; the unit modules of a stage and their errors."""
from __future__ import annotations

import pytest

from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.core.ir.sharding import parse_sharding
from pipeblocks.models import GPTConfig

from _recompute_cases import verify_worker

# 8 layers: two blocks per chunk at v=2 (elastic, bfs, zb-v), four at v=1 (1f1b)
MODEL = GPTConfig(layers=8, hidden=16, heads=2, seq=8, vocab=256, dtype="float64")
SCHEDULES = {"1f1b": (), "zb-v": (), "elastic": (("forward_groups", "2,2"), ("backward_groups", "4")), "bfs": ()}
CASES = [(name, policy, grain) for name in SCHEDULES for policy in ("replicate", "zero1", "zero3")
         for grain in ("chunk", "block")]


@pytest.fixture(scope="module")
def runs():
    from pipeblocks.runtime import spawn
    from pipeblocks.train.run import prepare

    prepared = []
    for name, policy, grain in CASES:
        request = ScheduleRequest(name=name, m=4, mesh=Mesh(pp=2, dp=2), options=SCHEDULES[name],
                                  sharding=parse_sharding(policy), costs=CostSpec(dp_unit=grain))
        prepared.append(prepare(request, model=MODEL, microbatch_size=1, verify=True, timeout_s=120.0))
    per_rank = spawn(verify_worker, 4, args=([cfg for cfg, _ in prepared],), timeout_s=300, threads_per_rank=1)
    return {case: (cfg, data, [rank[i] for rank in per_rank]) for i, (case, (cfg, data)) in enumerate(zip(CASES, prepared))}


@pytest.mark.spawn
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_verify_passes_at_both_grains(runs, case):
    from pipeblocks.train.run import judge

    cfg, data, results = runs[case]
    assert cfg.mesh.dp_unit == case[2]
    largest, tolerance, lines = judge(cfg, data, results)
    assert largest <= tolerance, "\n".join(lines)


@pytest.mark.torch
def test_unit_modules_hold_whole_blocks_with_the_end_parts():
    from pipeblocks.models import build_stages
    from pipeblocks.runtime.dp_units import unit_modules

    first, last = build_stages(GPTConfig(layers=4, hidden=8, heads=2, seq=8, vocab=16), seed=0, num_stages=2,
                               stages=(0, 1))
    groups = unit_modules(first, (1, 1))
    assert groups[0][0] is first.part("embed") and groups[0][1] is first.block_items()[0][1]
    assert groups[1] == [first.block_items()[1][1]]
    assert unit_modules(last, (2,))[0][-1] is last.part("head")
    with pytest.raises(ValueError, match=r"stage 0 has 2 blocks but its DP units hold 3 \(\(1, 2\)\)"):
        unit_modules(first, (1, 2))
    import torch

    with pytest.raises(ValueError, match="need stage modules that list their blocks .* use --dp-unit chunk"):
        unit_modules(torch.nn.Linear(2, 2), (1, 1))
