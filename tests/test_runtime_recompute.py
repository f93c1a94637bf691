"""Recomputation in the runtime: a recomputed pair's forward keeps only its input, the
RECOMPUTE op rebuilds the graph before the backward, and the gradients are those of the
run without recomputation, bit for bit (also with dropout: the random state is replayed);
the measured activation memory is what the simulator predicts with recomputation.

One spawn (p=2) runs every case; `test_runtime_exact.py` and `test_runtime_memory.py`
cover `1f1b-r` against one process as for every registered schedule.
"""
from __future__ import annotations

import pytest
import torch

from pipeblocks.core import Costs
from pipeblocks.core.simulator.simulate import simulate
from pipeblocks.models.toy import cross_entropy, toy_batch, toy_stages
from pipeblocks.runtime import spawn
from pipeblocks.runtime.profile import profile_stage_memory

from _recompute_cases import CASES, MICROBATCH, P, anchors_of, config_of, pairs_of, recompute_worker, schedule_of

pytestmark = pytest.mark.spawn

TOLERANCE = 0.10  # as test_runtime_memory.py
# each recomputing case against the same schedule without recomputation
BASELINE = {"1f1b-r": "1f1b", "zb-h1+all": "zb-h1", "interleaved+some": None, "v-half+all": "v-half",
            "v-half+placed": "v-half"}


@pytest.fixture(scope="module")
def runs():
    per_rank = spawn(recompute_worker, P, args=(list(CASES),), timeout_s=150, threads_per_rank=1)
    return {case: [r[case] for r in per_rank] for case in CASES}, [r["dropout"] for r in per_rank]


def predicted(case: str) -> tuple[float, ...]:
    schedule = schedule_of(case)
    config = config_of(case)
    x, y = toy_batch(MICROBATCH, config)
    profile = profile_stage_memory(toy_stages(schedule.num_stages, config), x, cross_entropy, y)
    costs = Costs(mem_b=tuple(float(s.m_b) for s in profile), mem_w_ratio=1.0,
                  recompute_input_ratio=tuple(s.input_ratio for s in profile))
    return simulate(schedule, costs, recompute=pairs_of(case) or (), recompute_at=anchors_of(case)).peak_activation


def _grads(per_rank) -> dict[int, list[torch.Tensor]]:
    return {stage: grads for r in per_rank for stage, grads in r["grads"].items()}


@pytest.mark.parametrize("case", [c for c, base in BASELINE.items() if base is not None])
def test_gradients_equal_the_run_without_recomputation(runs, case):
    measured, _ = runs
    got, want = _grads(measured[case]), _grads(measured[BASELINE[case]])
    schedule = schedule_of(case)
    assert sum(r["recomputes"] for r in measured[case]) == schedule.num_stages * schedule.m, "every pair recomputed"
    assert len(anchors_of(case)) == (7 if case == "v-half+placed" else 0)
    assert got.keys() == want.keys()
    for stage in got:
        for a, b in zip(got[stage], want[stage], strict=True):
            assert torch.equal(a, b), f"stage {stage}: recomputation changed a gradient"
    loss = [r["loss"] for r in measured[case] if r["loss"] is not None]
    assert loss == [r["loss"] for r in measured[BASELINE[case]] if r["loss"] is not None]


def test_partial_recomputation_is_exact_against_one_process(runs):
    measured, _ = runs
    case = "interleaved+some"
    assert [r["recomputes"] for r in measured[case]] == [2, 3]  # stages 0, 2 on rank 0; 1, 3 on rank 1
    schedule = schedule_of(case)
    stages = toy_stages(schedule.num_stages, config_of(case))
    x, y = toy_batch(MICROBATCH * schedule.m, config_of(case), seed=2)
    h = x
    for stage in stages:
        h = stage(h)
    cross_entropy(h, y).backward()
    got = _grads(measured[case])
    for s, module in enumerate(stages):
        for a, param in zip(got[s], module.parameters(), strict=True):
            scale = param.grad.abs().max().item()
            assert (a - param.grad).abs().max().item() <= 1e-10 * scale, f"stage {s}"


@pytest.mark.parametrize("case", [c for c in CASES if c not in BASELINE.values()])
def test_measured_memory_matches_simulator(runs, case):
    measured, _ = runs
    runs_ = measured[case]
    assert [r["left"] for r in runs_] == [0] * P, "every saved tensor and kept input is freed by the end"
    for rank, (run, want) in enumerate(zip(runs_, predicted(case))):
        assert run["peak"] == pytest.approx(want, rel=TOLERANCE), f"rank {rank}: measured {run['peak']}, predicted {want}"


def test_recomputation_saves_what_the_simulator_says(runs):
    """1F1B's first rank holds p microbatches; recomputed it holds their inputs and one graph."""
    measured, _ = runs
    got = measured["1f1b-r"][0]["peak"] / measured["1f1b"][0]["peak"]
    want = predicted("1f1b-r")[0] / predicted("1f1b")[0]
    assert got == pytest.approx(want, rel=TOLERANCE)
    assert got < 0.75


def test_dropout_is_replayed(runs):
    _, dropout = runs
    for rank in dropout:
        plain, recomputed = rank[False], rank[True]
        assert plain["loss"] == recomputed["loss"]
        assert plain["after"] == recomputed["after"], "the recomputation consumed random numbers"
        for stage in plain["grads"]:
            for a, b in zip(plain["grads"][stage], recomputed["grads"][stage], strict=True):
                assert torch.equal(a, b), f"stage {stage}: the recomputation drew another dropout mask"
