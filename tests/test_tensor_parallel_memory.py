"""Memory under tensor parallelism: per process, the static and the peak saved-activation
bytes of a p = 2 x tp = 2 run of the reference GPT, measured by the runtime, within 5% of
`sim.memory_estimate.estimate_memory(..., tp=2)` (the planner's estimate), in fp32 under
1f1b and zb-v and in bf16-mixed under 1f1b; and each tp rank of stage 0 sends its token
shard, [b, s/2, h], half the activation. The cases run in one set of 4 processes."""
from __future__ import annotations

import pytest

from pipeblocks.resolve.request import Mesh, ScheduleRequest
from pipeblocks.models.config import GPTConfig
from pipeblocks.runtime import spawn
from pipeblocks.schedules import get
from pipeblocks.sim.analytic import TransformerConfig
from pipeblocks.sim.memory_estimate import estimate_memory
from pipeblocks.train.run import prepare

from _tp_cases import tp_memory_worker

pytestmark = pytest.mark.spawn

MODEL = GPTConfig(layers=4, hidden=64, heads=4, seq=64, vocab=256)
MICROBATCH = 2
CASES = {"1f1b-fp32": ("1f1b", "fp32"), "zb-v-fp32": ("zb-v", "fp32"), "1f1b-bf16-mixed": ("1f1b", "bf16-mixed")}


@pytest.fixture(scope="module")
def runs():
    cfgs = [prepare(ScheduleRequest(name=name, m=4, mesh=Mesh(pp=2, tp=2)), model=MODEL, precision=precision,
                    microbatch_size=MICROBATCH, steps=2, quiet=True, timeout_s=120.0)[0]
            for name, precision in CASES.values()]
    per_rank = spawn(tp_memory_worker, 4, args=(cfgs,), timeout_s=300, threads_per_rank=1)
    return {case: [rank[i] for rank in per_rank] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", list(CASES))
def test_measured_memory_is_estimate_memory_at_tp2(runs, case):
    name, precision = CASES[case]
    analytic = TransformerConfig(layers=MODEL.layers, hidden=MODEL.hidden, heads=MODEL.heads, seq=MODEL.seq,
                                 vocab=MODEL.vocab, microbatch_size=MICROBATCH, dtype="fp32", flash_attention=True,
                                 dropout=False)
    estimate = estimate_memory(analytic, get(name)(p=2, m=4), precision=precision, tp=2)
    for result, _ in runs[case]:
        predicted = estimate.rank(result.rank)
        assert result.static_bytes_measured == pytest.approx(predicted.static_bytes, rel=0.05), (case, result.rank)
        assert result.peak_activation_bytes == pytest.approx(predicted.activation_bytes, rel=0.05), (case, result.rank)


def test_stage0_sends_its_token_shard(runs):
    sent = [shape for _, shape in runs["1f1b-fp32"] if shape is not None]
    assert sent == [(MICROBATCH, MODEL.seq // 2, MODEL.hidden)] * 2
