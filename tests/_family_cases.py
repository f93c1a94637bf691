"""Shared by the `--verify` matrices over model families (test_verify_families.py,
test_tensor_parallel_verify.py): prepare every case of one mesh and run them all in one
set of processes, as `train --verify` would, one after another."""
from __future__ import annotations

from typing import Callable

from pipeblocks.resolve.request import Mesh, ScheduleRequest
from pipeblocks.core.ir.sharding import parse_sharding
from pipeblocks.runtime import spawn
from pipeblocks.train.run import prepare

from _recompute_cases import verify_worker

PP = 2


def verify_runs(cases: dict[str, tuple[str, str, str]], model: Callable[[str, str], object], *, dp: int,
                tp: int = 1) -> dict:
    """case -> (cfg, data, one RankResult per process) for cases of (family, schedule, precision),
    on a PP x dp x tp mesh (zero3 when dp > 1); `model(family, dtype)` gives the family's config."""
    prepared = {}
    for case, (family, name, precision) in cases.items():
        request = ScheduleRequest(name=name, m=4, mesh=Mesh(pp=PP, dp=dp, tp=tp),
                                  sharding=parse_sharding("zero3" if dp > 1 else "replicate"))
        prepared[case] = prepare(request, model=model(family, "float64" if precision == "fp64" else "float32"),
                                 family=family, precision=precision, microbatch_size=1, verify=True, timeout_s=120.0)
    per_rank = spawn(verify_worker, PP * dp * tp, args=([cfg for cfg, _ in prepared.values()],), timeout_s=300,
                     threads_per_rank=1)
    return {case: (cfg, data, [rank[i] for rank in per_rank]) for i, (case, (cfg, data)) in enumerate(prepared.items())}
