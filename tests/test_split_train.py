"""`train --split`: the ranks build the stages the split gives, and `--verify` is exact.

One set of 2 processes runs `train --verify`'s rank body for 1f1b at --split 1,3 and for
zb-v (V placement: rank 0 holds stages 0 and 3) at --split 2,1,1,1, in float64."""
from __future__ import annotations

import re

import pytest

from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.models import GPTConfig
from pipeblocks.runtime import spawn
from pipeblocks.train.run import judge, prepare

from _recompute_cases import verify_worker

pytestmark = pytest.mark.spawn

CASES = {"1f1b": (4, (1, 3)), "zb-v": (5, (2, 1, 1, 1))}


def _config(name: str):
    layers, split = CASES[name]
    request = ScheduleRequest(name=name, m=4, mesh=Mesh(pp=2), costs=CostSpec(split=split))
    model = GPTConfig(layers=layers, hidden=16, heads=2, seq=8, vocab=256, dtype="float64")
    return prepare(request, model=model, microbatch_size=1, verify=True, timeout_s=120.0)


@pytest.fixture(scope="module")
def runs():
    prepared = {name: _config(name) for name in CASES}
    per_rank = spawn(verify_worker, 2, args=([cfg for cfg, _ in prepared.values()],), timeout_s=240,
                     threads_per_rank=1)
    return {name: (cfg, data, [rank[i] for rank in per_rank]) for i, (name, (cfg, data)) in enumerate(prepared.items())}


def _blocks(names) -> set[int]:
    return {int(m.group(1)) for n in names for m in [re.search(r"blocks\.(\d+)\.", n)] if m}


@pytest.mark.parametrize("name", list(CASES))
def test_the_ranks_hold_the_split_and_verify_is_exact(runs, name):
    cfg, data, results = runs[name]
    split = CASES[name][1]
    assert cfg.schedule.split == split and cfg.stage_layers == split
    starts = [sum(split[:s]) for s in range(len(split))]
    for result in results:
        want = {starts[s] + i for s in result.stages for i in range(split[s])}
        assert _blocks(result.grads) == want, (result.rank, sorted(result.grads))
    largest, tolerance, lines = judge(cfg, data, results)
    assert largest <= tolerance, "\n".join(lines)
