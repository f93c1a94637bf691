"""Checkpoints of a tensor-parallel run (torch.distributed.checkpoint, DTensor shards): a run
at tp = 2 resumes exactly, and its checkpoint loads at tp = 1 (with dp = 2, the same global
batch). One set of 4 processes runs, in order: 4 straight steps at p = 2 x tp = 2; 2 steps
saved; a resume at tp = 2 to step 3; a resume of that at tp = 1 x dp = 2 (zero3) to step 4."""
from __future__ import annotations

import dataclasses

import pytest

from pipeblocks.resolve.request import Mesh, ScheduleRequest
from pipeblocks.core.ir.sharding import parse_sharding
from pipeblocks.models.llama_config import LlamaConfig
from pipeblocks.runtime import spawn
from pipeblocks.train import sharded_checkpoint as sharded
from pipeblocks.train.config import CheckpointSpec
from pipeblocks.train.run import prepare

from _recompute_cases import verify_worker

pytestmark = pytest.mark.spawn

MODEL = LlamaConfig(layers=2, hidden=16, heads=2, kv_heads=2, seq=8, dtype="float64")


def _config(*, tp: int, dp: int = 1, m: int = 4, steps: int, checkpoint: str | None = None):
    request = ScheduleRequest(name="1f1b", m=m, mesh=Mesh(pp=2, dp=dp, tp=tp),
                              sharding=parse_sharding("zero3" if dp > 1 else "replicate"))
    # a constant rate: the default schedule's horizon is --steps, which differs between the runs compared
    cfg, _ = prepare(request, model=MODEL, family="llama", microbatch_size=1, steps=steps, quiet=True,
                     timeout_s=120.0, checkpoint=checkpoint, lr=3e-3, lr_schedule="constant")
    return cfg


def _losses(results) -> list[tuple[int, float]]:
    found = {(step, loss) for r in results for step, loss in r.losses}
    assert len({step for step, _ in found}) == len(found), found  # tp ranks and replicas agree
    return sorted(found)


def test_tp2_checkpoint_resumes_exactly_and_loads_at_tp1(tmp_path):
    ck = str(tmp_path / "ck")
    straight = _config(tp=2, steps=4)
    first = _config(tp=2, steps=2, checkpoint=ck)
    again = dataclasses.replace(first, steps=3, checkpoint=CheckpointSpec(ck, resume=True))
    elsewhere = dataclasses.replace(_config(tp=1, dp=2, m=2, steps=4), checkpoint=CheckpointSpec(ck, resume=True))
    per_rank = spawn(verify_worker, 4, args=([straight, first, again, elsewhere],), timeout_s=300,
                     threads_per_rank=1)
    runs = [_losses([rank[i] for rank in per_rank]) for i in range(4)]
    expected = dict(runs[0])
    assert [s for s, _ in runs[1]] == [0, 1] and [s for s, _ in runs[2]] == [2] and [s for s, _ in runs[3]] == [3]
    for step, loss in runs[1] + runs[2]:  # the same arithmetic at tp = 2: bit for bit
        assert loss == expected[step], (step, loss, expected[step])
    (step, loss), = runs[3]  # tp = 1 x dp = 2 sums in another order
    assert loss == pytest.approx(expected[step], rel=1e-10, abs=0)
    assert sharded.latest_sharded_step(ck) == 4
    assert sharded.read_marker(ck, 3)["world_size"] == 4 and "tp" not in sharded.read_marker(ck, 3)["meta"]
