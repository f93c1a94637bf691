"""Invariant 3: the runtime's measured peak saved-activation bytes per rank agree with the
simulator fed per-stage activation bytes profiled from the same modules.

Every schedule runs the same model (6 blocks, cut into its stages). The profile gives, per
stage, M_B (what F saves) and M_W (what the graph split keeps from B until W). The
simulator takes one M_W/M_B ratio for all stages; the runtime keeps everything but the
region above the topmost join node, which is empty except on the last stage (the loss),
so ratio 1 is the prediction and, for split schedules, an upper bound.
"""
from __future__ import annotations

import pytest

from pipeblocks import schedules
from pipeblocks.runtime import spawn
from pipeblocks.runtime.profile import profile_stage_memory
from pipeblocks.models.toy import cross_entropy, toy_batch, toy_stages
from pipeblocks.sim import Costs, simulate

from _runtime_cases import EXTRA, MICROBATCH, build, memory_config, memory_worker, try_build

pytestmark = pytest.mark.spawn

P, M, BLOCKS = 3, 6, 6
CASES = schedules.names() + EXTRA
TOLERANCE = 0.10


def _runnable(case: str) -> str | None:
    reason = try_build(case, P, M)
    if reason is None and build(case, P, M).seq_chunks > 1:
        reason = "sequence chunks need the attention model; their memory is checked in test_runtime_sequence.py"
    if reason is None and BLOCKS % build(case, P, M).num_stages:
        reason = f"its {build(case, P, M).num_stages} stages do not divide the {BLOCKS}-block model"
    return reason


@pytest.fixture(scope="module")
def measured():
    cases = [(case, M) for case in CASES if _runnable(case) is None]
    per_rank = spawn(memory_worker, P, args=(cases, BLOCKS), timeout_s=150, threads_per_rank=1)
    return {case: [r[case] for r in per_rank] for case, _ in cases}


def predicted(case: str) -> tuple[tuple[float, ...], float]:
    schedule = build(case, P, M)
    stages = toy_stages(schedule.num_stages, memory_config(schedule, BLOCKS))
    x, y = toy_batch(MICROBATCH, memory_config(schedule, BLOCKS))
    profile = profile_stage_memory(stages, x, cross_entropy, y)
    assert all(s.m_w <= s.m_b for s in profile)
    # a recomputed forward (1f1b-r) keeps its stage input: the profiled share of M_B
    costs = Costs(mem_b=tuple(float(s.m_b) for s in profile), mem_w_ratio=1.0,
                  recompute_input_ratio=tuple(s.input_ratio for s in profile))
    return simulate(schedule, costs).peak_activation, min(s.w_ratio for s in profile)


@pytest.mark.parametrize("case", CASES)
def test_peak_per_rank_matches_simulator(measured, case):
    reason = _runnable(case)
    if reason is not None:
        pytest.skip(f"{case}: {reason}")
    runs = measured[case]
    assert [r["left"] for r in runs] == [0] * P, "every saved tensor is freed by the end of the step"
    prediction, _ = predicted(case)
    split = build(case, P, M).has_split_backward
    for rank, (run, want) in enumerate(zip(runs, prediction)):
        got = run["peak"]
        assert got == pytest.approx(want, rel=TOLERANCE), f"rank {rank}: measured {got} B, predicted {want:.0f} B"
        if split:
            assert got <= want * (1 + 1e-9), f"rank {rank}: ratio 1 is an upper bound for split schedules"
        else:
            assert got == pytest.approx(want, rel=1e-9), f"rank {rank}: fused backward frees exactly what F saved"


@pytest.mark.parametrize("case", ["v-half", "v-min"])
def test_v_schedules_against_1f1b(measured, case):
    """The V family's memory saving over 1F1B, measured, is the one the simulator predicts."""
    for name in (case, "1f1b"):
        reason = _runnable(name)
        if reason is not None:
            pytest.skip(f"{name}: {reason}")
    got = max(r["peak"] for r in measured[case]) / max(r["peak"] for r in measured["1f1b"])
    want = max(predicted(case)[0]) / max(predicted("1f1b")[0])
    assert got == pytest.approx(want, rel=TOLERANCE)
    assert got < 1.0, f"{case} holds less than 1F1B at p={P}"
